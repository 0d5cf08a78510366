"""Peer methods on the same weights and prompt ids: transformers `generate` (plain, assisted, prompt lookup)
and llama.cpp through llama-cpp-python (plain, prompt lookup). Optional: `pip install specdecode[peers]`."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.runs import PeerUnavailable, RunOutput
from specdecode.models.catalog import resolve

PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value, also llama-cpp-python's default


def build(kind: str, name: str, target: str, draft: str, dtype: str):
    if kind == "hf-plain":
        return HFMethod(name, hf_model(target, dtype))
    if kind == "hf-assisted":
        return HFMethod(name, hf_model(target, dtype), {"assistant_model": hf_model(draft, dtype)})
    if kind == "hf-prompt-lookup":
        return HFMethod(name, hf_model(target, dtype), {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS})
    if kind in ("llama-cpp", "llama-cpp-prompt-lookup"):
        return LlamaCppMethod.load(name, target, prompt_lookup=kind.endswith("prompt-lookup"))
    raise ValueError(kind)


@functools.cache
def hf_model(model: str, dtype: str):
    """transformers' model on the same weights; GGUF dequantized at load, as we do (its packed GGUF path
    unpacks weights on every forward, a different comparison)."""
    from transformers import AutoModelForCausalLM, GgufConfig
    from transformers.utils import logging

    logging.set_verbosity_error()  # its per-call deprecation notices would bury the progress bar
    logging.disable_progress_bar()
    os.environ.setdefault("TQDM_DISABLE", "1")  # its GGUF loader's own tqdm bar
    path = resolve(model)
    kwargs: dict[str, Any] = {}
    if path.is_file():
        try:
            import accelerate  # noqa: F401  (transformers needs it to load GGUF files)
        except ImportError:
            raise PeerUnavailable("loading a GGUF file into transformers needs `accelerate` "
                                  "(pip install specdecode[peers])") from None
        kwargs = {"gguf_file": path.name, "quantization_config": GgufConfig(dequantize=True)}
    folder = path.parent if path.is_file() else path
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), **kwargs).eval()


@dataclass
class HFMethod:
    name: str
    model: Any
    extra: dict | None = None  # assistant_model / prompt_lookup_num_tokens

    def __post_init__(self) -> None:
        self.calls = 0  # target forwards, counted by a hook: each one yields >= 1 token, as our steps do
        self.model.register_forward_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.calls += 1

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            eos_ids: list[int]) -> RunOutput:
        eos = sorted(eos_ids)
        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                      do_sample=temperature > 0, **(self.extra or {}))
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(temperature=None, top_k=None, top_p=None)
        ids = torch.tensor([prompt_ids])
        torch.manual_seed(seed)
        self.calls = 0
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - t
        new = out[0, len(prompt_ids):].tolist()
        if new and new[-1] in eos:  # our engine does not return the eos token
            new = new[:-1]
        return RunOutput(new, seconds, self.calls)


@dataclass
class LlamaCppMethod:
    """Plain decoding of the same GGUF file by llama.cpp (its own quantized kernels), or its prompt lookup."""

    name: str
    llm: Any

    @classmethod
    def load(cls, name: str, target: str, prompt_lookup: bool) -> LlamaCppMethod:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise PeerUnavailable("llama-cpp-python is not installed (pip install specdecode[peers]; "
                                  "it builds llama.cpp from source, ~15 minutes on 2 cores)") from None
        path = Path(resolve(target))
        if not path.is_file():
            raise PeerUnavailable(f"llama.cpp needs a GGUF file; {path} is a folder")
        draft = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS) if prompt_lookup else None
        llm = Llama(model_path=str(path), n_ctx=8192, n_threads=torch.get_num_threads(), n_batch=512,
                    draft_model=draft, verbose=False)
        return cls(name, llm)

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            eos_ids: list[int]) -> RunOutput:
        llm = self.llm
        eos = set(eos_ids)
        evals = 0
        plain_eval = type(llm).eval

        def counting_eval(tokens):
            nonlocal evals
            evals += 1
            return plain_eval(llm, tokens)

        llm.eval = counting_eval
        llm.set_seed(seed)
        out: list[int] = []
        t = time.perf_counter()
        llm.reset()  # no prefix reuse between runs: every method pays its prefill
        try:
            for tok in llm.generate(prompt_ids, temp=temperature, top_k=1 if temperature == 0 else 0,
                                    top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True):
                if tok in eos:
                    break
                out.append(int(tok))
                if len(out) >= max_new_tokens:
                    break
        finally:
            del llm.eval
        return RunOutput(out, time.perf_counter() - t, evals)  # the prefill's eval yields the first token
