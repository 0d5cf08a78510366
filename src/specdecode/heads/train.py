"""`specdecode train-draft`: train a drafting head on this CPU by self-distillation from the target.

The stream: chunks of token ids (heads/data.py) run through the target once each, which gives the head its inputs
(the target's hidden states) and its labels (the target's own next-token logits on the draft vocabulary: the head
learns the target's distribution, KL as EAGLE-3 does, not the text). Each new chunk trains one step, then `replay`
steps on earlier chunks kept in a small buffer; nothing is written to disk but checkpoints. A seeded run is
reproducible, and a resumed run equals an uninterrupted one (the checkpoint holds the buffer and every random state).
A held-out split (the first conversations and text chunks, never trained on, their second halves replaced by the
target's greedy continuation) gives the learning curve: acceptance at draft positions 1..4 of greedy chains, against
tokens seen.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch

from specdecode.errors import InvalidRequestError
from specdecode.heads import data
from specdecode.heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from specdecode.heads.format import Head, save_head
from specdecode.heads.medusa import MedusaConfig, MedusaHeads
from specdecode.models.decoder import Transformer
from specdecode.models.loading import LoadedModel

KINDS = ("eagle3", "medusa")
HELD_OUT = 4  # chunks: the first conversations and text chunks, never trained on
POSITIONS = 4  # draft positions the learning curve reports


@dataclass
class TrainOptions:
    kind: str = "eagle3"
    minutes: float = 60.0  # training time at most (feature extraction included; resumed runs add up)
    tokens: int | None = None  # or this many tokens at most
    seed: int = 0
    draft_vocab: int = 16384  # the head's vocabulary: the most frequent target tokens of the training text
    vocab_tokens: int = 2_000_000  # tokens of training text counted to choose it
    seq_len: int = 512  # tokens per chunk
    conversations: int = 64  # written by the target before training (saved beside the checkpoint)
    ttt_steps: int = 3  # eagle3: unrolled drafting steps trained on the head's own outputs
    medusa_heads: int = 4
    intermediate: int | None = None  # eagle3 MLP width (default: twice the hidden size)
    lr: float = 1e-3
    train_lm_head: bool = False  # the head's vocabulary rows stay the target's own (as EAGLE-1's): less to learn
    replay: int = 1  # steps on earlier chunks per new chunk
    buffer: int = 4  # chunks kept for replay
    eval_every: int = 16  # chunks between learning-curve points
    checkpoint_minutes: float = 5.0
    text: tuple[str, ...] = ()  # files or folders of training text (default: the Python installation's)

    def check(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.minutes <= 0 or (self.tokens is not None and self.tokens <= 0):
            raise InvalidRequestError("--minutes and --tokens must be positive")
        if self.draft_vocab < 16 or self.seq_len < data.MIN_CHUNK:
            raise InvalidRequestError(f"--draft-vocab must be >= 16 and the chunk length >= {data.MIN_CHUNK}")
        if missing := [t for t in self.text if not Path(t).exists()]:
            raise InvalidRequestError(f"--text: no such file or folder: {', '.join(missing)}")


def embed(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """The target's token embeddings [..., D] float32 (a learned head shares them)."""
    with torch.inference_mode():
        return model.embed_tokens(ids).float().clone()


def lm_head_rows(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """The target's lm_head weight rows of `ids`, [len(ids), D] float32, read through its kernel (identity inputs,
    whatever the kernel's layout), to start a head's vocabulary where the target's is."""
    D = model.config.hidden_size
    cols = []
    with torch.inference_mode():
        for i in range(0, D, 256):
            eye = torch.eye(D)[i:i + 256].to(model.dtype)
            cols.append(model.lm_head(eye.unsqueeze(0))[0][:, ids].float())  # [n, len(ids)]
    return torch.cat(cols).T.contiguous()


class Features:
    """What the target computes for a chunk: the head's inputs and its labels (float16 to keep the buffer small)."""

    def __init__(self, model: Transformer, layers: tuple[int, ...], draft_ids: torch.Tensor, seq_len: int) -> None:
        self.model, self.layers, self.draft_ids = model, layers, draft_ids
        self.cache = model.new_cache(1, seq_len + 1)

    def __call__(self, ids: list[int]) -> dict[str, torch.Tensor]:
        hidden: dict[int, torch.Tensor] = {layer: torch.empty(0) for layer in self.layers}
        logits = self.model(torch.tensor([ids]), torch.tensor([0]), self.cache, num_logits=len(ids),
                            hidden=hidden)[0]  # [L, V]
        return {"ids": torch.tensor(ids), "features": torch.cat([hidden[n][0] for n in self.layers], -1).half(),
                "teacher": logits[:, self.draft_ids].half(), "argmax": logits.argmax(-1)}


def draft_outputs(head: Head, model: Transformer, rec: dict[str, torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Per draft position k = 1..steps, the head's draft-vocabulary logits at each start t: [n_k, Vd].

    eagle3: pair t (features at t, token t + 1) drafts tokens t + 2, t + 3, ... by unrolled steps.
    medusa: the last hidden state at t drafts tokens t + 2, t + 3, ... by its heads.
    Either way draft k at t is the target's distribution at position t + k (its logits there): `teacher[t + k]`.
    """
    ids, feats = rec["ids"], rec["features"].float()
    L = len(ids)
    if isinstance(head, Eagle3Head):
        T = L - 1
        tokens = torch.cat([ids[1:], ids.new_zeros(steps - 1)])
        outs = head.unrolled(feats[:T].unsqueeze(0), embed(model, tokens).unsqueeze(0), steps)
        return [head.logits(o[0, :max(T - k, 0)]) for k, o in enumerate(outs)]
    outs = head.outputs(feats)
    return [head.lm_head(o[:max(L - 1 - k, 0)]) for k, o in enumerate(outs[:steps])]


def loss_of(head: Head, model: Transformer, rec: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
    """Cross-entropy to the target's distribution on the draft vocabulary (KL up to a constant), later draft
    positions weighted 0.8^k as EAGLE-3 does. Medusa's head k does not see the tokens between its position and the
    one it drafts, which drafting only reaches where the target chose them: its loss counts only the starts where the
    text's tokens there are the target's greedy choices (an EAGLE-3 head reads each token it conditions on)."""
    total = torch.zeros(())
    follows = rec["ids"][1:] == rec["argmax"][:-1]  # [L-1]: token t+1 is the target's greedy choice at t
    for k, logits in enumerate(draft_outputs(head, model, rec, steps)):
        n = logits.shape[0]
        if n == 0:
            break
        p = torch.softmax(rec["teacher"][1 + k:1 + k + n].float(), -1)
        ce = -(p * torch.log_softmax(logits, -1)).sum(-1)  # [n]
        if isinstance(head, MedusaHeads):
            mask = torch.stack([follows[j:j + n] for j in range(k + 1)]).all(0).float()
            total = total + 0.8 ** k * (ce * mask).sum() / mask.sum().clamp_min(1.0)
        else:
            total = total + 0.8 ** k * ce.mean()
    return total


@torch.no_grad()
def acceptance(head: Head, model: Transformer, recs: list[dict[str, torch.Tensor]]) -> list[float]:
    """Acceptance of greedy chains at draft positions 1..POSITIONS: the share of starts whose first k drafts all
    equal the target's greedy tokens (the target's own argmax on the full vocabulary), among the starts where the
    text follows the target's greedy choice for those k tokens (so the head saw what drafting would give it)."""
    hits, valid = [0] * POSITIONS, [0] * POSITIONS
    for rec in recs:
        ids, a = rec["ids"], rec["argmax"]
        outs = draft_outputs(head, model, rec, POSITIONS)
        L = len(ids)
        follows = ids[1:] == a[:-1]  # [L-1]: the text's token t+1 is the target's greedy choice at t
        for t in range(L - 1):
            ok_text, ok_draft = True, True
            for k in range(POSITIONS):  # draft k+1 at t is token t + 2 + k, the target's choice at t + 1 + k
                if t + 1 + k >= L or t >= outs[k].shape[0]:
                    break
                ok_text = ok_text and bool(follows[t + k])
                if not ok_text:
                    break
                ok_draft = ok_draft and int(head.draft_ids[outs[k][t].argmax()]) == int(a[t + 1 + k])
                valid[k] += 1
                hits[k] += ok_draft
    return [h / v if v else 0.0 for h, v in zip(hits, valid)]


def new_head(opts: TrainOptions, model: Transformer, draft_ids: torch.Tensor) -> Head:
    cfg = model.config
    head: Head
    if opts.kind == "eagle3":
        head = Eagle3Head(Eagle3Config(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       opts.intermediate or 2 * cfg.hidden_size, cfg.rms_norm_eps, cfg.rope_theta,
                                       cfg.vocab_size, default_aux_layers(cfg.num_layers),
                                       cfg.max_position_embeddings), draft_ids)
    else:
        head = MedusaHeads(MedusaConfig(cfg.hidden_size, opts.medusa_heads, cfg.rms_norm_eps, cfg.vocab_size,
                                        cfg.num_layers), draft_ids, model.norm)
    head.lm_head.weight.data = lm_head_rows(model, draft_ids)
    head.lm_head.weight.requires_grad_(opts.train_lm_head)
    return head


def feature_layers(head: Head) -> tuple[int, ...]:
    return head.cfg.aux_layers if isinstance(head, Eagle3Head) else (head.cfg.layer,)


def choose_vocab(counts: torch.Tensor, size: int, always: set[int]) -> torch.Tensor:
    """The `size` most frequent ids (ties by id), `always` included; sorted ascending (the speculators format's
    d2t offsets assume so)."""
    size = min(size, len(counts))
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    chosen = set(i for i in always if i < len(counts))
    for i in order:
        if len(chosen) >= size:
            break
        chosen.add(i)
    return torch.tensor(sorted(chosen)[:max(size, len(always))])


def train_draft(target: LoadedModel, out: Path, opts: TrainOptions, *, resume: bool = False,
                target_name: str = "", report: Callable[[dict], None] | None = None,
                progress: bool = True) -> Path:
    """Train a head for `target` into `out` (checkpoint.pt while training; the head's files at the end); returns
    `out`. report: called with each learning-curve point (a dict) as it is measured."""
    opts.check()
    torch.manual_seed(opts.seed)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    state = torch.load(ckpt_path, weights_only=False) if resume and ckpt_path.exists() else None
    if state is not None and state["options"] != asdict(opts) | {"minutes": state["options"]["minutes"],
                                                                  "tokens": state["options"]["tokens"]}:
        raise InvalidRequestError(f"{ckpt_path} was trained with other options ({state['options']}); pass the same "
                                  "ones, or a new --out")
    model, tok = target.model, target.tokenizer
    if tok is None:
        raise InvalidRequestError("training a head needs the target's tokenizer")
    written = [0]

    def wrote(tokens: int) -> None:
        written[0] += 1
        if report is not None and (written[0] % 8 == 0 or written[0] == opts.conversations):
            report({"conversations": written[0], "of": opts.conversations})

    convs, conv_seconds = data.load_or_write_conversations(out / "conversations.json", model, tok,
                                                           opts.conversations, opts.seed, wrote)

    def stream():
        return data.chunks(convs, tok, opts.seed, opts.seq_len, tuple(Path(t).resolve() for t in opts.text))

    if state is None:
        counts = data.token_counts(stream(), model.config.vocab_size, opts.vocab_tokens)
        specials = set(model.config.eos_token_ids) | {i for i in tok.all_special_ids if i is not None}
        draft_ids = choose_vocab(counts, opts.draft_vocab, specials)
    else:
        draft_ids = state["draft_ids"]
    head = new_head(opts, model, draft_ids)
    optim = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=opts.lr, betas=(0.9, 0.95),
                              weight_decay=0.0)
    rng = random.Random(opts.seed)
    feats = Features(model, feature_layers(head), draft_ids, opts.seq_len)
    held = [feats(c) for c in data.greedy_continued(model, tok, list(islice(stream(), HELD_OUT)))]
    buffer: list[dict[str, torch.Tensor]] = []
    chunks_done = tokens = steps = 0
    elapsed = conv_seconds  # the budget counts the conversations the target wrote
    curve: list[dict] = []
    window: list[float] = []  # training losses since the last learning-curve point
    if state is not None:
        head.load_state_dict(state["head"])
        optim.load_state_dict(state["optim"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        buffer, curve, window[:] = state["buffer"], state["curve"], state.get("window", [])
        chunks_done, tokens, steps, elapsed = state["chunks"], state["tokens"], state["steps"], state["elapsed"]
    steps_ahead = opts.ttt_steps if opts.kind == "eagle3" else opts.medusa_heads
    budget_s = opts.minutes * 60

    def save() -> None:
        torch.save({"options": asdict(opts), "draft_ids": draft_ids, "head": head.state_dict(),
                    "optim": optim.state_dict(), "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                    "buffer": buffer, "curve": curve, "window": window, "chunks": chunks_done, "tokens": tokens,
                    "steps": steps, "elapsed": elapsed}, ckpt_path.with_suffix(".tmp"))
        ckpt_path.with_suffix(".tmp").replace(ckpt_path)

    def point() -> None:
        acc = acceptance(head, model, held)
        expected = 1 + sum(acc)  # a chain of POSITIONS drafts: the bonus token plus each position reached
        with torch.no_grad():
            held_loss = sum(float(loss_of(head, model, r, steps_ahead)) for r in held) / len(held)
        p = {"tokens": tokens, "minutes": round(elapsed / 60, 2), "steps": steps,
             "loss": round(sum(window) / len(window), 4) if window else None, "held_out_loss": round(held_loss, 4),
             "acceptance": [round(a, 4) for a in acc], "tokens_per_step": round(expected, 3)}
        window.clear()
        curve.append(p)
        (out / "curve.json").write_text(json.dumps(curve, indent=1))
        if report is not None:
            report(p)

    def train_on(rec: dict[str, torch.Tensor]) -> float:
        nonlocal steps
        step_lr = opts.lr * min(1.0, (steps + 1) / 20)
        for g in optim.param_groups:
            g["lr"] = step_lr
        loss = loss_of(head, model, rec, steps_ahead)
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optim.step()
        steps += 1
        window.append(float(loss.detach()))
        return window[-1]

    if not curve:
        point()
    source = islice(stream(), HELD_OUT + chunks_done, None)
    bar = _progress(progress, budget_s, elapsed)
    last_save = time.perf_counter()
    loss = float("nan")
    while elapsed < budget_s and (opts.tokens is None or tokens < opts.tokens):
        t0 = time.perf_counter()
        ids = next(source, None)
        if ids is None:
            break
        rec = feats(ids)
        loss = train_on(rec)
        for _ in range(opts.replay):
            if buffer:
                train_on(buffer[rng.randrange(len(buffer))])
        buffer = (buffer + [rec])[-opts.buffer:]
        chunks_done += 1
        tokens += len(ids)
        elapsed += time.perf_counter() - t0
        if chunks_done % opts.eval_every == 0:
            point()
        if bar is not None:
            bar.update(elapsed, tokens, loss, curve[-1])
        if time.perf_counter() - last_save > opts.checkpoint_minutes * 60:
            save()
            last_save = time.perf_counter()
    if curve[-1]["tokens"] != tokens:
        point()
    save()
    if bar is not None:
        bar.close()
    save_head(head, out, target_name=target_name, target=model, trained={"tokens": tokens, "minutes":
                                                                         round(elapsed / 60, 2), "steps": steps})
    return out


class _Bar:
    def __init__(self, total_s: float, done_s: float) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        self.task = self.progress.add_task("train-draft", total=total_s, completed=int(done_s), info="")
        self.progress.start()

    def update(self, elapsed: float, tokens: int, loss: float, last: dict) -> None:
        acc = " ".join(f"{a:.2f}" for a in last["acceptance"])
        self.progress.update(self.task, completed=elapsed,
                             info=f"{tokens} tokens, loss {loss:.3f}, held-out acceptance {acc}")

    def close(self) -> None:
        self.progress.stop()


def _progress(on: bool, total_s: float, done_s: float) -> _Bar | None:
    return _Bar(total_s, done_s) if on else None
