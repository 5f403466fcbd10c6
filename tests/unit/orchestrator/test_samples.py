from orch_fakes import fake_output

from asyncrl.orchestrator.samples import TrajectoryConverter


def test_single_turn_sample():
    out = fake_output(3, 0.5, [([1, 2, 3], [7, 8])], metrics={"m": 1.0, "flag": True})
    r = TrajectoryConverter("interleaved").convert(out, "env")
    assert r.ok and r.reward == 0.5 and r.example_id == 3 and r.num_turns == 1
    (s,) = r.samples
    assert s.input_ids == [1, 2, 3, 7, 8]
    assert s.loss_mask == [False, False, False, True, True]
    assert s.logprobs[:3] == [0.0] * 3 and s.logprobs[3] < 0
    assert r.prompt_len == 3 and r.completion_len == 2 and r.metrics == {"m": 1.0}


def test_interleaved_masks_env_tokens_between_turns():
    turn1 = ([1, 2], [5, 6])
    turn2 = ([1, 2, 5, 6, 40, 41, 42], [7])
    turn3 = ([1, 2, 5, 6, 40, 41, 42, 7, 43], [8, 9])
    r = TrajectoryConverter("interleaved").convert(fake_output(0, 1.0, [turn1, turn2, turn3]), "env")
    (s,) = r.samples
    assert s.input_ids == [1, 2, 5, 6, 40, 41, 42, 7, 43, 8, 9]
    assert s.loss_mask == [False, False, True, True, False, False, False, True, False, True, True]
    assert [lp != 0 for lp in s.logprobs] == s.loss_mask
    assert r.completion_len == 5 and r.num_turns == 3


def test_prefix_break_falls_back_to_branching_and_counts():
    conv = TrajectoryConverter("interleaved")
    turns = [([1, 2], [5, 6]), ([1, 2, 99, 40], [7])]  # turn 2 rewrote the completion (e.g. stripped thinking)
    r = conv.convert(fake_output(0, 1.0, turns), "env")
    assert conv.fallbacks == 1 and len(r.samples) == 2
    assert r.samples[1].input_ids == [1, 2, 99, 40, 7]
    assert r.samples[1].loss_mask == [False] * 4 + [True]


def test_branching_gives_one_sample_per_turn():
    turns = [([1, 2], [5, 6]), ([1, 2, 5, 6, 40], [7])]
    r = TrajectoryConverter("branching").convert(fake_output(0, 1.0, turns), "env")
    assert [s.input_ids for s in r.samples] == [[1, 2, 5, 6], [1, 2, 5, 6, 40, 7]]
    assert r.samples[1].loss_mask == [False] * 5 + [True]


def test_errors_become_masked_rollouts_not_exceptions():
    conv = TrajectoryConverter()
    err = conv.convert(
        fake_output(
            0,
            0.0,
            [([1], [2])],
            error={
                "error": "ModelError",
                "message": "x",
                "error_chain_repr": "ModelError(conn refused)",
                "error_chain_str": "x",
            },
        ),
        "e",
    )
    assert not err.ok and "conn refused" in err.error and err.samples == []
    no_tokens = fake_output(0, 1.0, [([1], [2])])
    no_tokens["trajectory"][0]["tokens"] = None
    assert "token ids" in conv.convert(no_tokens, "e").error
    empty = fake_output(0, 1.0, [])
    assert "no model turns" in conv.convert(empty, "e").error
    bad = fake_output(0, 1.0, [([1], [2, 3])])
    bad["trajectory"][0]["tokens"]["completion_logprobs"] = [-1.0]
    assert "logprobs" in conv.convert(bad, "e").error
    unscored = fake_output(0, 1.0, [([1], [2])])
    unscored["reward"] = None
    assert not conv.convert(unscored, "e").ok
