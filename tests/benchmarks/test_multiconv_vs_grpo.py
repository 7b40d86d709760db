"""benchmarks/multiconv_vs_grpo.py: both arms read the same problems with the same generated tokens a sample, and
the time to a held-out accuracy is read off the runs' metrics."""

import pytest

from benchmarks.multiconv_vs_grpo import arm_config, arm_summary, main, summarize, time_to_target


def test_the_arms_differ_only_in_how_a_problem_is_read():
    """The two configs parse; the same held-out problems (the single form's prompt holds the chunks and the
    question), the same algorithm, optimizer and batch, and the same generated tokens a sample at most: the
    segmented episode's memory writes and answer."""
    from allsync.config import parse_config

    multiconv, single = (parse_config(arm_config(arm, 4, 1, 2)) for arm in ("multiconv", "single"))
    assert multiconv.producer.kind == "multiconv" and single.producer.kind == "single_turn"
    assert (
        (multiconv.run.steps, multiconv.run.seed, multiconv.run.eval_every)
        == (4, 1, 2)
        == (
            single.run.steps,
            single.run.seed,
            single.run.eval_every,
        )
    )
    assert multiconv.algorithm == single.algorithm and multiconv.optim == single.optim
    assert (multiconv.rollout.prompts_per_step, multiconv.rollout.group_size) == (
        single.rollout.prompts_per_step,
        single.rollout.group_size,
    )
    segments = multiconv.task.chunks
    assert (
        single.rollout.max_new_tokens == segments * multiconv.producer.memory_tokens + multiconv.rollout.max_new_tokens
    )
    held_multi, held_single = multiconv.task.splits()[0].heldout, single.task.splits()[0].heldout
    assert [(p.answer, p.metadata) for p in held_multi] == [(p.answer, p.metadata) for p in held_single]
    assert all(
        q.prompt.endswith(p.prompt) and p.metadata["chunks"][0] in q.prompt for p, q in zip(held_multi, held_single)
    )


def test_steps_and_seconds_to_the_target():
    rows = [{"step": 0, "heldout_accuracy": 0.3}]
    rows += [{"step": s, "step_seconds": 10.0 + s, "response_length": 11.0} for s in range(1, 7)]
    rows += [
        {"step": 2, "heldout_accuracy": 0.6},
        {"step": 4, "heldout_accuracy": 0.92},
        {"step": 6, "heldout_accuracy": 0.91},
    ]
    assert time_to_target(rows, 0.9) == (4, 11.0 + 12.0 + 13.0 + 14.0)
    assert time_to_target(rows, 0.95) == (None, None)
    summary = summarize(rows, 0.9)
    assert summary["final"] == 0.91 and summary["steps_to_target"] == 4 and summary["seconds_per_step"] == 14.0
    never = summarize(rows, 0.95)
    arm = arm_summary([summary, never])
    assert arm["reached"] == "1 of 2" and arm["steps_mean"] == 4 and arm["final_min"] == arm["final_max"] == 0.91


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arms", "multiconv,solo"], "--arms: unknown arm 'solo'"),
        (["--eval-every", "0"], "--eval-every: must be at least 1"),
        (["--target", "1.5"], "--target: a held-out accuracy in"),
    ],
)
def test_bad_arguments_are_refused_before_any_run(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--out", str(tmp_path)])
