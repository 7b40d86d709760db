"""An adapter sync that proves itself: after every sync to an engine that holds its own copy of the adapter (vLLM),
the trainer and the engine show that the engine runs the adapter the trainer sent, or the run stops naming the version.

Two checks, both cheap next to a step:
    checksum   SHA-256 of the adapter's tensors (names in sorted order, then each tensor's bytes), computed by the
               trainer over what it sends and by the engine's worker over what it received. Equal, or a tensor was
               dropped, cut or changed on the way.
    effect     the adapter's effect on a fixed probe (a prompt and a continuation), per continuation token t:
                   d_engine(t)  = log p_engine(t | adapter) - log p_engine(t | no adapter)
                   d_trainer(t) = log p_trainer(t | adapter) - log p_trainer(t | adapters off)
               gap = mean_t |d_engine(t) - d_trainer(t)|. Differences of the two bases (vLLM serving the checkpoint's
               FP8 beside an NF4 trainer) cancel in each d to first order; what is left grows with the adapter's
               effect, and the rounding of the two engines is at most what they differ by on the base alone:
                   effect   = mean_t |d_trainer(t)|
                   mismatch = mean_t |log p_engine(t | no adapter) - log p_trainer(t | adapters off)|
                   stop if gap > tolerance x effect + mismatch       (tolerance: rollout.sync_probe_tolerance)
               The bound is a share of the adapter's effect whatever its size: an adapter (or a part of it, one module
               kind) the engine received but does not apply leaves its part of d_engine at 0, so gap is that part's
               share of the effect, caught from the first small update once it is more than `tolerance` of it.
               (Before, the bound was tolerance x (1 + effect) nats: a dropped part passed until it moved the probe
               by ~tolerance nats per token.)
Users of other RL stacks lose weeks to adapters that never reached the engine: a sync that silently failed looks
like staleness or a bad learning rate.
"""

from __future__ import annotations

import hashlib

import torch

# the probe's text: the continuation's tokens are scored given the prompt's
PROBE_PROMPT = "What is 12 + 7?"
PROBE_CONTINUATION = " Answer: 19"


class AdapterSyncError(RuntimeError):
    """The engine does not run the adapter the trainer sent (names the version and what differs)."""


def adapter_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over the names in sorted order and each tensor's bytes as stored (float32 on the CPU)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()  # no copy when it is that already
        digest.update(name.encode())
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.numpy())  # its buffer, not a copy
    return digest.hexdigest()


def probe_ids(tokenizer) -> tuple[list[int], int]:
    """The probe's token ids (BOS, prompt, continuation) and where the continuation starts."""
    prompt = tokenizer(PROBE_PROMPT)["input_ids"]
    continuation = tokenizer(PROBE_CONTINUATION, add_special_tokens=False)["input_ids"]
    return prompt + continuation, len(prompt)


def effect_gap(engine_with: list[float], engine_without: list[float], trainer_with, trainer_without) -> tuple:
    """(gap, effect, mismatch) over the probe's scored tokens: mean_t |(engine_with - engine_without) -
    (trainer_with - trainer_without)|, the trainer's mean_t |trainer_with - trainer_without| and the bases'
    mean_t |engine_without - trainer_without|."""
    engine_base = torch.tensor(engine_without, dtype=torch.float64)
    trainer_base = torch.as_tensor(trainer_without, dtype=torch.float64)
    engine = torch.tensor(engine_with, dtype=torch.float64) - engine_base
    trainer = torch.as_tensor(trainer_with, dtype=torch.float64) - trainer_base
    return (
        float((engine - trainer).abs().mean()),
        float(trainer.abs().mean()),
        float((engine_base - trainer_base).abs().mean()),
    )


def check_checksums(version: int, sent: str, received: list[str]) -> None:
    """Raise AdapterSyncError when any engine worker received other bytes than were sent."""
    wrong = [i for i, checksum in enumerate(received) if checksum != sent]
    if wrong:
        raise AdapterSyncError(
            f"adapter version {version}: engine worker {wrong[0]} received tensors with SHA-256 {received[wrong[0]][:16]}, "
            f"the trainer sent {sent[:16]}: the sync lost or changed tensors on the way; stopping instead of "
            "training on samples from another adapter"
        )


def check_sync(
    version: int, sent: str, received: list[str], gap: float, effect: float, mismatch: float, tolerance: float
) -> None:
    """`check_checksums`, then AdapterSyncError when the adapter's effect on the probe differs between engine and
    trainer by more than tolerance x effect + mismatch nats per token (module docstring)."""
    check_checksums(version, sent, received)
    if not gap <= tolerance * effect + mismatch:  # NaN too
        raise AdapterSyncError(
            f"adapter version {version}: the engine's logprobs of the sync probe move by {gap:.3g} nats per token "
            f"unlike the trainer's, whose move by {effect:.3g} (bound: rollout.sync_probe_tolerance = {tolerance} of "
            f"that, plus the bases' own {mismatch:.3g}): the engine does not apply (all of) the adapter it received; "
            "stopping instead of training on samples from another adapter"
        )
