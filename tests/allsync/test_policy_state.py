"""A policy's state is one object (allsync/update/policy_state.py): a worker can hold two on one frozen base, and each
trains as it would alone."""

import pytest
import torch

from allsync.run.worker import RLWorker
from allsync.update.policy_state import PolicyState
from tests.allsync.test_update_correctness import PROBLEMS, config, groups


def trained_alone(base, batches) -> dict[str, torch.Tensor]:
    worker = RLWorker(config(base), PROBLEMS)
    try:
        for samples, index in batches:
            worker.train(samples, index)
            worker.policy.version += 1
        return {name: p.detach().clone() for name, p in worker.policy.adapter.items()}
    finally:
        worker.shutdown()


def test_two_policies_on_one_base_train_as_each_would_alone(tiny_bf16):
    """Policy a (the worker's own) and policy b (a second PolicyState on the same model, its adapter drawn from the
    same seed) take turns on one worker, each on its own batches; after two updates each has the tensors (and AdamW
    step counts) of a worker that trained only it, bit for bit, and the frozen base is one copy."""
    batches_a, batches_b = [groups(0, 2), groups(1, 2)], [groups(2, 2), groups(3, 2)]
    worker = RLWorker(config(tiny_bf16), PROBLEMS)
    try:
        a = worker.policy
        frozen = {id(p) for p in worker.model.parameters() if not p.requires_grad}
        b = PolicyState(worker.model, worker.config, worker.groups, worker.layout, worker.device, seed=0)
        assert {id(p) for p in worker.model.parameters() if not p.requires_grad} == frozen  # the base is shared
        assert not {id(p) for p in a.lora_params} & {id(p) for p in b.lora_params}
        for (xa, ia), (xb, ib) in zip(batches_a, batches_b):
            for policy, samples, index in ((a, xa, ia), (b, xb, ib)):
                policy.attach(worker.model)
                worker.learner.train(policy, samples, index)
                policy.version += 1
        for policy, batches in ((a, batches_a), (b, batches_b)):
            alone = trained_alone(tiny_bf16, batches)
            assert sorted(alone) == sorted(policy.adapter)
            for name, p in policy.adapter.items():
                torch.testing.assert_close(p.detach(), alone[name], atol=0, rtol=0, msg=name)
            assert {int(s["step"]) for s in policy.optimizer.state.values()} == {2 * 2}  # 2 minibatches x 2 updates
        assert any(not torch.equal(p, q) for p, q in zip(a.lora_params, b.lora_params))  # other data, other tensors
    finally:
        worker.shutdown()


def test_a_policy_attaches_only_to_a_model_with_its_lora_modules(tiny_bf16):
    worker = RLWorker(config(tiny_bf16), PROBLEMS)
    try:
        policy = worker.policy
        policy.adapter.pop(next(iter(policy.adapter)))
        with pytest.raises(ValueError, match="are not the LoRA tensors this model's modules hold"):
            policy.attach(worker.model)
    finally:
        worker.shutdown()
