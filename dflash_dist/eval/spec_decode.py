"""Greedy speculative decoding with a DFlash drafter and the real target (evaluation, not serving).

One prompt at a time (batch 1)::

    prefill:  target(prompt) -> features of positions 0..P-1, bonus = argmax at the last position (token P)
    loop:     p = position of the last emitted token (the "bonus", not yet seen by the target)
              block  = [bonus, MASK x (B-1)] at positions p..p+B-1
              drafts = argmax lm_head(drafter(block, context = target features of positions 0..p-1))[1:]
                       (mask: the block sees every context position < p and its whole block: training's
                       ``kv < anchor`` rule with anchor p)
              verify = target([bonus, drafts]) at positions p..p+B-1 -> posterior[k] = argmax at p+k
              acc    = longest k with drafts[0..k-1] == posterior[0..k-1]
              emit drafts[:acc] + posterior[acc]  (acc + 1 tokens per verify step)
              features of positions p..p+acc join the context; the target cache is cut back to p+acc+1

The output is, token for token, the target's own greedy decoding (up to floating-point differences between
a B-token and a 1-token forward, which can flip an argmax at a near tie in bf16; fp32/fp64 CPU runs are exact
in practice). The drafter is recomputed over the whole context for every block (no drafter KV cache); the
target uses an HF ``DynamicCache`` cropped after each verify (``use_cache=None`` picks it for pure
full-attention targets) or, with ``use_cache=False``, a full forward over the accepted sequence plus the block.

Statistics follow the DFlash paper/benchmark: the acceptance length of a verify step is ``acc + 1`` (tokens
it emits, counting the target's own token), τ is its mean. Nothing here touches torch.distributed, so the
target ranks can call :func:`evaluate_prompts` during training, or advance :func:`evaluate_steps` (a generator)
a slice at a time between their other forwards.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Generator, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from dflash_dist.eval.drafting import DraftFn, draft_rows, make_dflash_draft_fn, unwrap_drafter
from dflash_dist.eval.target_runner import TargetRunner, cache_supported, crop_cache, new_cache
from dflash_dist.targets.hf import head_weights

__all__ = ["TargetRunner", "make_dflash_draft_fn", "draft_rows", "unwrap_drafter", "speculative_generate", "speculative_steps", "target_greedy",
           "evaluate_prompts", "evaluate_steps", "run_to_end", "summarize_acceptance", "format_table",
           "cache_supported", "pack_state", "unpack_state_", "DraftFn"]


# ----------------------------------------------------------------------------------------------- target



# ----------------------------------------------------------------------------------------------- drafter

def pack_state(model, dtype: torch.dtype = torch.float32) -> Tensor:
    """All of ``model``'s state (state_dict order; or a state dict in that order) as one contiguous 1-D tensor on
    its device, e.g. for the leader drafter to ``dist.send`` to a target rank. The receiver allocates
    ``torch.empty(n)`` with ``n = sum(v.numel() for v in DFlashDrafter(same config).state_dict().values())`` and
    calls :func:`unpack_state_`."""
    state = model if isinstance(model, dict) else unwrap_drafter(model).state_dict()
    return torch.cat([v.detach().reshape(-1).to(dtype) for v in state.values()])


@torch.no_grad()
def unpack_state_(model: nn.Module, flat: Tensor) -> nn.Module:
    """Inverse of :func:`pack_state` in place (casts to each tensor's dtype/device); returns ``model``."""
    sd = unwrap_drafter(model).state_dict()
    n = sum(v.numel() for v in sd.values())
    if flat.numel() != n:
        raise ValueError(f"flat state has {flat.numel()} values, the model needs {n} (different drafter config?)")
    off = 0
    for v in sd.values():
        v.copy_(flat[off:off + v.numel()].view(v.shape))
        off += v.numel()
    return model


# ----------------------------------------------------------------------------------------------- decoding

def _as_ids(prompt_ids: Union[Tensor, Sequence[int]], device) -> Tensor:
    t = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1).to(device)
    if t.shape[1] < 1:
        raise ValueError("empty prompt")
    return t


def _target_device(target) -> torch.device:
    return next(target.parameters()).device


def _resolve_use_cache(target, use_cache: Optional[bool]) -> bool:
    if use_cache is None:
        return cache_supported(target)
    if use_cache and not cache_supported(target):
        raise ValueError("use_cache=True but this target's cache cannot be cropped exactly (non-attention layers "
                         "or no cache argument): use use_cache=False or None")
    return bool(use_cache)


def run_to_end(gen: Generator) -> Any:
    """Advance ``gen`` until it finishes; returns its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as e:
            return e.value


class _Clock:
    """Running time of a generator: stopped while it is suspended, so sliced and unsliced runs report alike."""

    def __init__(self):
        self.total = 0.0
        self._t: Optional[float] = time.monotonic()

    def stop(self) -> None:
        self.total += time.monotonic() - self._t
        self._t = None

    def start(self) -> None:
        self._t = time.monotonic()

    def pause(self):
        """``yield from clock.pause()``: one yield to the caller, not counted."""
        self.stop()
        yield
        self.start()

    def seconds(self) -> float:
        return self.total + (time.monotonic() - self._t if self._t is not None else 0.0)


# inference_mode on a generator function is entered on each resume and left at each yield (torch wraps it), so
# the caller's own forwards between slices run in its grad mode
@torch.inference_mode()
def speculative_steps(target, drafter: Union[nn.Module, DraftFn], embed: Optional[Tensor], lm_head: Optional[Tensor],
                      prompt_ids: Union[Tensor, Sequence[int]], layer_ids: Sequence[int], mask_token_id: int,
                      block_size: int, max_new_tokens: int, eos_ids: Iterable[int] = (),
                      use_cache: Optional[bool] = None, runner: Optional[TargetRunner] = None
                      ) -> Generator[None, None, tuple[list[int], dict]]:
    """:func:`speculative_generate` as a generator: yields None after the prefill and after each verify step,
    returns its (new token ids, stats). The runner's hooks are attached only around each target forward, so the
    caller may run the target (e.g. through a FeatureCapture) between slices; ``wall_s`` excludes the time spent
    suspended."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: must be >= 2")
    clock = _Clock()
    dev = _target_device(target)
    if embed is None or lm_head is None:
        e, h = head_weights(target)
        embed = e if embed is None else embed
        lm_head = h if lm_head is None else lm_head
    draft_fn = make_dflash_draft_fn(drafter, embed, lm_head) if isinstance(drafter, nn.Module) else drafter
    use_cache = _resolve_use_cache(target, use_cache)
    runner = runner or TargetRunner(target, layer_ids)
    if list(runner.layer_ids) != [int(i) for i in layer_ids]:
        raise ValueError(f"runner captures {runner.layer_ids}, drafter needs {list(layer_ids)}")
    eos = {int(i) for i in eos_ids}
    ids = _as_ids(prompt_ids, dev)
    n_prompt = ids.shape[1]
    B = int(block_size)
    out: list[int] = []
    acc_lens: list[int] = []
    per_pos = [0] * (B - 1)
    stop = "max_new_tokens"

    def emit(tokens: list[int]) -> bool:
        nonlocal stop
        for t in tokens:
            out.append(t)
            if t in eos:
                stop = "eos"
                return True
            if len(out) >= max_new_tokens:
                return True
        return False

    if max_new_tokens <= 0:
        return [], _stats(acc_lens, per_pos, out, n_prompt, stop, clock.seconds())
    # the cache lives across slices; the hooks do not (the caller's forwards between slices need their own)
    cache = new_cache(target) if use_cache else None
    with runner.attached():
        logits, ctx = runner(ids, 0, cache, keep=1)
    bonus = int(logits[0, -1].argmax())
    seq = ids  # accepted tokens whose features are in ctx (positions 0..p-1); the bonus is at p
    done = emit([bonus])
    yield from clock.pause()
    while not done:
        p = seq.shape[1]
        block = torch.full((1, B), int(mask_token_id), dtype=torch.long, device=dev)
        block[0, 0] = bonus
        drafts = draft_fn(ctx, block, p).to(dev).reshape(-1)
        if drafts.numel() != B - 1:
            raise RuntimeError(f"draft function returned {drafts.numel()} tokens, expected {B - 1}")
        block[0, 1:] = drafts
        with runner.attached():
            if use_cache:
                logits, feats = runner(block, p, cache, keep=B)
            else:
                logits, feats = runner(torch.cat([seq, block], dim=1), 0, None, keep=B)
        posterior = logits[0].argmax(-1)                                    # [B]: prediction for p+1..p+B
        match = (drafts == posterior[:-1]).long().cumprod(0)
        acc = int(match.sum())
        per_pos = [c + int(k < acc) for k, c in enumerate(per_pos)]
        acc_lens.append(acc + 1)
        new = block[0, 1:acc + 1].tolist() + [int(posterior[acc])]
        if use_cache:
            crop_cache(cache, p + acc + 1)
            ctx = torch.cat([ctx, feats[:, :acc + 1]], dim=1)
        else:
            ctx = feats[:, :p + acc + 1]
        seq = torch.cat([seq, block[:, :acc + 1]], dim=1)
        bonus = new[-1]
        done = emit(new)
        yield from clock.pause()
    return out, _stats(acc_lens, per_pos, out, n_prompt, stop, clock.seconds())


def speculative_generate(target, drafter: Union[nn.Module, DraftFn], embed: Optional[Tensor], lm_head: Optional[Tensor],
                         prompt_ids: Union[Tensor, Sequence[int]], layer_ids: Sequence[int], mask_token_id: int,
                         block_size: int, max_new_tokens: int, eos_ids: Iterable[int] = (),
                         use_cache: Optional[bool] = None, runner: Optional[TargetRunner] = None
                         ) -> tuple[list[int], dict]:
    """Greedy DFlash speculative decoding of one prompt. Returns (new token ids, stats).

    ``drafter``: a DFlashDrafter (optionally DDP-wrapped) or a ``DraftFn``. ``embed``/``lm_head``: the target's
    [V, H] weights (None: taken from ``target``). Generation stops after ``max_new_tokens`` tokens or on the
    first token in ``eos_ids`` (included). stats: ``acceptance_lengths`` (acc+1 per verify step, not cut by
    max_new_tokens/EOS), ``steps``, ``tau`` (None without a verify step), ``accepted_per_position`` (length B-1:
    in how many steps draft slot k = 1..B-1 was accepted), ``new_tokens``, ``prompt_tokens``, ``stop``
    (``eos`` or ``max_new_tokens``), ``wall_s``. Runs :func:`speculative_steps` to the end.
    """
    return run_to_end(speculative_steps(target, drafter, embed, lm_head, prompt_ids, layer_ids, mask_token_id,
                                        block_size, max_new_tokens, eos_ids, use_cache=use_cache, runner=runner))


def _stats(acc_lens, per_pos, out, n_prompt, stop, wall_s) -> dict:
    return {"acceptance_lengths": list(acc_lens), "steps": len(acc_lens),
            "tau": (sum(acc_lens) / len(acc_lens)) if acc_lens else None,
            "accepted_per_position": list(per_pos), "new_tokens": len(out), "prompt_tokens": int(n_prompt),
            "stop": stop, "wall_s": wall_s}


@torch.inference_mode()
def target_greedy(target, prompt_ids: Union[Tensor, Sequence[int]], max_new_tokens: int,
                  eos_ids: Iterable[int] = (), use_cache: Optional[bool] = None) -> list[int]:
    """The target's own greedy decoding (one token per forward): the reference for losslessness."""
    dev = _target_device(target)
    use_cache = _resolve_use_cache(target, use_cache)
    eos = {int(i) for i in eos_ids}
    ids = _as_ids(prompt_ids, dev)
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    runner = TargetRunner(target, [])
    with runner.attached():
        cache = new_cache(target) if use_cache else None
        logits, _ = runner(ids, 0, cache, keep=1)
        while True:
            t = int(logits[0, -1].argmax())
            out.append(t)
            if t in eos or len(out) >= max_new_tokens:
                return out
            nxt = torch.tensor([[t]], device=dev)
            if use_cache:
                logits, _ = runner(nxt, ids.shape[1], cache, keep=1)
                ids = torch.cat([ids, nxt], dim=1)
            else:
                ids = torch.cat([ids, nxt], dim=1)
                logits, _ = runner(ids, 0, None, keep=1)


# ----------------------------------------------------------------------------------------------- evaluation

def summarize_acceptance(per_prompt_lengths: Sequence[Sequence[int]], block_size: int,
                         exclude_one_step: bool = True) -> dict:
    """Acceptance lengths (acc+1 per verify step) of each prompt, summarized.

    ``acceptance_length`` (the headline; also ``tau_pooled``): all acc+1 tokens / all verify steps, every verify
    step weighing the same: what a long generation sees. ``tau``: z-lab's benchmark figure ("Average Acceptance
    length" of ``dflash/benchmark.py``, the mean over prompts of each prompt's mean acceptance length) over the
    prompts it counts: with ``exclude_one_step`` those whose generation ended inside their first block are left
    out (``prompts_one_step`` counts them): their whole output came from one draft, accepted in one step, so each
    adds a per-prompt figure near the block size however the drafter does on longer text. ``tau_all_prompts``:
    z-lab's mean over every prompt (what z-lab's script prints); ``tau_stderr``: ``tau``'s standard error over
    its prompts (None under 2); ``prompts_scored``: prompts with a verify step; ``prompts_in_tau``: those ``tau``
    counts. ``per_position_acceptance[k-1]``: fraction of verify steps whose draft slot k was accepted
    (acceptance length >= k+1); ``per_position_conditional[k-1]``: the same among steps that accepted slots
    1..k-1 (None if none did); ``acceptance_histogram[L]``: fraction of steps with acceptance length L (0..B).
    Prompts without a verify step are left out of every figure.
    """
    B = int(block_size)
    lens = [int(x) for seq in per_prompt_lengths for x in seq]
    bad = [x for x in lens if not 1 <= x <= B]
    if bad:
        raise ValueError(f"acceptance lengths must be in 1..{B}, got {bad[:5]}")
    scored = [s for s in per_prompt_lengths if len(s)]
    counted = [s for s in scored if len(s) > 1] if exclude_one_step else scored
    means = [sum(s) / len(s) for s in counted]
    all_means = [sum(s) / len(s) for s in scored]
    n = len(lens)
    tau = (sum(means) / len(means)) if means else None
    # standard error of tau (mean over prompts): the spread of the per-prompt means / sqrt(prompts)
    sem = (math.sqrt(sum((m - tau) ** 2 for m in means) / (len(means) - 1) / len(means))
           if len(means) > 1 else None)
    reached = [sum(1 for x in lens if x >= k) for k in range(1, B + 1)]      # slot k-1 accepted or k==1
    accepted = [sum(1 for x in lens if x >= k + 1) for k in range(1, B)]     # slot k accepted
    pooled = (sum(lens) / n) if n else None
    return {
        "acceptance_length": pooled,
        "tau_pooled": pooled,
        "tau": tau,
        "tau_stderr": sem,
        "tau_all_prompts": (sum(all_means) / len(all_means)) if all_means else None,
        "prompts_scored": len(scored),
        "prompts_one_step": sum(1 for s in per_prompt_lengths if len(s) == 1),
        "prompts_in_tau": len(means),
        "one_step_excluded": bool(exclude_one_step),
        "per_position_acceptance": [a / n if n else None for a in accepted],
        "per_position_conditional": [accepted[k - 1] / reached[k - 1] if reached[k - 1] else None
                                     for k in range(1, B)],
        "acceptance_histogram": [sum(1 for x in lens if x == L) / n if n else 0.0 for L in range(B + 1)],
        "total_steps": n,
    }


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()  # entered per resume, left at each yield (see speculative_steps)
def evaluate_steps(target, drafter: Union[nn.Module, DraftFn], embed: Optional[Tensor], lm_head: Optional[Tensor],
                   prompts: Sequence[Union[Tensor, Sequence[int]]], layer_ids: Sequence[int], mask_token_id: int,
                   block_size: int, max_new_tokens: int, eos_ids: Iterable[int] = (), check_lossless: bool = True,
                   use_cache: Optional[bool] = None, keep_outputs: bool = False, exclude_one_step: bool = True,
                   progress: Optional[Callable[[int, int], None]] = None, batch_size: int = 1
                   ) -> Generator[None, None, dict]:
    """:func:`evaluate_prompts` as a generator: yields None wherever :func:`speculative_steps` does (after each
    target forward of the speculative path; the :func:`target_greedy` reference runs whole inside one slice) and
    returns the same summary; ``wall_s`` and ``tokens_per_s`` exclude the time spent suspended. The drafter's
    train/eval mode is restored when the generator finishes or is closed. ``progress(done, total)`` is called
    after each prompt. ``batch_size`` > 1 decodes that many prompts together (eval/batched.py; an nn.Module
    drafter, a target with a full-attention cache), each prompt as it would alone: a batch is decoded whole when
    its first prompt comes up, and the generator yields after each prompt."""
    clock = _Clock()
    eos = [int(i) for i in eos_ids]
    batched = None
    if batch_size > 1:
        if not isinstance(drafter, nn.Module):
            raise ValueError("batched evaluation needs the drafter module, not a draft function")
        from dflash_dist.eval.batched import batched_speculative

        def batches():
            for i in range(0, len(prompts), batch_size):
                yield from batched_speculative(target, drafter, embed, lm_head, prompts[i:i + batch_size], layer_ids,
                                               mask_token_id, block_size, max_new_tokens, eos, batch_size)
        batched = batches()
    was_training = drafter.training if isinstance(drafter, nn.Module) else None
    if isinstance(drafter, nn.Module):
        drafter.eval()
    runner = TargetRunner(target, layer_ids)
    per_prompt, all_lens = [], []
    spec_s, spec_tokens = 0.0, 0
    try:
        for prompt in prompts:
            # the per-prompt generator times its own running segments: add them instead of our suspended span
            clock.stop()
            if batched is not None:
                toks, st = next(batched)
            else:
                toks, st = yield from speculative_steps(target, drafter, embed, lm_head, prompt, layer_ids,
                                                        mask_token_id, block_size, max_new_tokens, eos,
                                                        use_cache=use_cache, runner=runner)
            clock.start()
            clock.total += st["wall_s"]
            spec_s += st["wall_s"]
            spec_tokens += len(toks)
            row = {"prompt_tokens": st["prompt_tokens"], "new_tokens": st["new_tokens"], "steps": st["steps"],
                   "tau": st["tau"], "stop": st["stop"], "acceptance_lengths": st["acceptance_lengths"]}
            if check_lossless:
                ref = target_greedy(target, prompt, max_new_tokens, eos, use_cache=use_cache)
                row["lossless"] = toks == ref
                row["first_mismatch"] = _first_mismatch(toks, ref)
                if keep_outputs:
                    row["reference"] = ref
            if keep_outputs:
                row["tokens"] = toks
            per_prompt.append(row)
            all_lens.append(st["acceptance_lengths"])
            if progress is not None:
                progress(len(per_prompt), len(prompts))
            if batched is not None:  # a prompt boundary for the caller (a graceful stop is checked there)
                yield from clock.pause()
    finally:
        if was_training:
            drafter.train()
    summary = summarize_acceptance(all_lens, block_size, exclude_one_step)
    n = len(per_prompt)
    summary.update({
        "n_prompts": n,
        "block_size": int(block_size),
        "batch_size": int(batch_size),
        "max_new_tokens": int(max_new_tokens),
        "lossless_fraction": (sum(r["lossless"] for r in per_prompt) / n if n else None) if check_lossless else None,
        "mean_new_tokens": (sum(r["new_tokens"] for r in per_prompt) / n) if n else 0.0,
        "tokens_per_s": spec_tokens / spec_s if spec_s > 0 else None,
        "wall_s": clock.seconds(),
        "per_prompt": per_prompt,
    })
    return summary


def evaluate_prompts(target, drafter: Union[nn.Module, DraftFn], embed: Optional[Tensor], lm_head: Optional[Tensor],
                     prompts: Sequence[Union[Tensor, Sequence[int]]], layer_ids: Sequence[int], mask_token_id: int,
                     block_size: int, max_new_tokens: int, eos_ids: Iterable[int] = (), check_lossless: bool = True,
                     use_cache: Optional[bool] = None, keep_outputs: bool = False, exclude_one_step: bool = True,
                     progress: Optional[Callable[[int, int], None]] = None, batch_size: int = 1) -> dict:
    """Speculative decoding over ``prompts`` (token-id lists); no torch.distributed, safe on any rank.

    Returns :func:`summarize_acceptance`'s figures (``acceptance_length`` the headline, ``tau`` z-lab's), ``per_position_acceptance``, ``per_position_conditional``,
    ``acceptance_histogram``, ``lossless_fraction`` (fraction of prompts whose output equals
    :func:`target_greedy`; None when ``check_lossless`` is False), ``n_prompts``, ``total_steps``,
    ``mean_new_tokens``, ``tokens_per_s`` (speculative path, this implementation), ``wall_s`` and
    ``per_prompt`` (steps, tau, new tokens, lossless, first mismatch index; token ids with ``keep_outputs``).
    Runs :func:`evaluate_steps` to the end.
    """
    return run_to_end(evaluate_steps(target, drafter, embed, lm_head, prompts, layer_ids, mask_token_id, block_size,
                                     max_new_tokens, eos_ids, check_lossless=check_lossless, use_cache=use_cache,
                                     keep_outputs=keep_outputs, exclude_one_step=exclude_one_step,
                                     progress=progress, batch_size=batch_size))


def format_table(result: dict) -> str:
    """A short human-readable report of :func:`evaluate_prompts`' result: the pooled acceptance length first,
    z-lab's per-prompt mean beside it."""
    def f(x, spec=".3f"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
    se = result.get("tau_stderr")
    one = result.get("prompts_one_step", "-")
    excluded = result.get("one_step_excluded", False)
    pooled = result.get("acceptance_length", result.get("tau_pooled"))
    lines = [f"prompts {result['n_prompts']}  block {result['block_size']}  max_new_tokens {result['max_new_tokens']}"
             f"  mean new tokens {f(result['mean_new_tokens'], '.1f')}  verify steps {result['total_steps']}"
             f"  ended in their first block {one}",
             f"acceptance length (pooled: all accepted+1 tokens / all verify steps) {f(pooled)}   lossless "
             f"{f(result['lossless_fraction'])}",
             f"tau (z-lab: mean over prompts of each prompt's mean acceptance length) {f(result['tau'])}"
             + (f" +- {f(se)} (std. error)" if se is not None else "")
             + (f", the {one} prompts that ended in their first block left out (all prompts: "
                f"{f(result.get('tau_all_prompts'))}; --include-one-step counts them)" if excluded and one else ""),
             "slot  accepted  conditional"]
    for k, (a, c) in enumerate(zip(result["per_position_acceptance"], result["per_position_conditional"]), start=1):
        lines.append(f"{k:>4}  {f(a):>8}  {f(c):>11}")
    return "\n".join(lines)
