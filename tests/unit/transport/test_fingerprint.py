"""Fingerprints of published weights (issue 47): stable across processes and dtypes, and the check that names
the first tensor a server loaded differently from what the trainer published."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncrl.core.errors import UserError
from asyncrl.orchestrator.loop import Orchestrator
from asyncrl.transport import fingerprint


def test_a_fingerprint_is_of_the_values_dtype_and_shape():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    same = fingerprint.of_tensor(t.clone())
    assert fingerprint.of_tensor(t) == same
    assert fingerprint.of_tensor(t.reshape(4, 3)) != same  # shape
    assert fingerprint.of_tensor(t.to(torch.bfloat16)) != same  # dtype
    nudged = t.clone()
    nudged[2, 3] = torch.nextafter(nudged[2, 3], torch.tensor(10.0))  # one ulp of one element
    assert fingerprint.of_tensor(nudged) != same


def test_a_server_computing_in_float32_matches_the_bfloat16_it_was_published_in():
    published = torch.randn(5, 7).to(torch.bfloat16)
    held = published.to(torch.float32)  # how the embedded engine holds it on CPU
    assert fingerprint.of_tensor(held, torch.bfloat16) == fingerprint.of_tensor(published)


@pytest.mark.parametrize("engine_dtype", [torch.float16, torch.bfloat16])
def test_an_engine_computing_in_half_precision_answers_for_the_float32_it_was_published_in(engine_dtype):
    """What a GPU engine does with `dtype = "auto"` for a float32 checkpoint: its weights are the published ones
    cast down, so the bytes differ, and it must still answer the published fingerprints; a changed value must not."""
    from asyncrl.inference.engine.weight_loading import loaded_fingerprints, staged, swap_in

    model = torch.nn.Linear(7, 5).to(engine_dtype)
    published = {"weight": torch.randn(5, 7), "bias": torch.randn(5)}
    swap_in(model, staged(model, published))
    assert loaded_fingerprints(model, published) == fingerprint.of_tensors(published)
    with torch.no_grad():
        model.weight[0, 0] += 1
    assert loaded_fingerprints(model, published)["weight"] != fingerprint.of_tensor(published["weight"])
    assert fingerprint.of_held(model.bias, published["bias"]) == fingerprint.of_tensor(published["bias"])


def test_the_check_names_the_first_tensor_that_differs(tmp_path):
    tensors = {"b.weight": torch.ones(2), "a.weight": torch.zeros(3)}
    fingerprint.write(tmp_path, fingerprint.of_tensors(tensors))
    loaded = fingerprint.of_tensors(tensors)
    assert fingerprint.mismatch(tmp_path, loaded) is None
    assert fingerprint.mismatch(tmp_path, None) is None  # an engine that gives none
    assert fingerprint.mismatch(tmp_path / "elsewhere", loaded) is None  # a dir published without them
    wrong = dict(loaded, **{"b.weight": fingerprint.of_tensor(torch.full((2,), 2.0))})
    assert fingerprint.mismatch(tmp_path, wrong).startswith("tensor b.weight (published ")
    del wrong["a.weight"]
    assert fingerprint.mismatch(tmp_path, wrong).endswith(", loaded nothing)")


def test_the_orchestrator_stops_before_sampling_with_one_line_naming_step_and_tensor(tmp_path):
    fingerprint.write(tmp_path, {"lm_head.weight": "0" * 16})
    orchestrator = SimpleNamespace(server=SimpleNamespace(root="http://10.0.0.2:8000"))
    Orchestrator._verify(orchestrator, 3, tmp_path, {"lm_head.weight": "0" * 16})  # the same: served
    with pytest.raises(UserError) as error:
        Orchestrator._verify(orchestrator, 3, tmp_path, {"lm_head.weight": "1" * 16})
    said = str(error.value)
    assert "\n" not in said and said.startswith("policy step 3: the inference server at http://10.0.0.2:8000")
    assert "tensor lm_head.weight (published 0000000000000000, loaded 1111111111111111)" in said
