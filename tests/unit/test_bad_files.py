"""Files another process wrote, found damaged on disk (a torn rollout batch, a corrupt orchestrator
checkpoint): one-line errors that name the file and what to do, never a traceback."""

import pytest
import torch

from asyncrl.orchestrator import ckpt
from asyncrl.transport.batch import FIELDS, read_batch, write_batch
from asyncrl.transport.layout import RunLayout
from asyncrl.utils.errors import UserError


def test_a_torn_rollout_batch_is_named(tmp_path):
    mb = {k: torch.zeros(8, dtype=torch.bool if k == "loss_mask" else torch.float32) for k in FIELDS}
    mb["input_ids"] = mb["position_ids"] = torch.arange(8)
    write_batch(tmp_path, 3, [[mb]])
    assert len(read_batch(tmp_path, 3, 0)) == 1
    path = RunLayout(tmp_path).batch_dir(3) / "rank_0.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match=rf"rollout batch {path} is unreadable .* restart the orchestrator"):
        read_batch(tmp_path, 3, 0)


@pytest.mark.parametrize("damage", ["{not json", '{"step": 2}', ""])
def test_a_corrupt_orchestrator_checkpoint_is_named(tmp_path, damage):
    layout = RunLayout(tmp_path)
    path = ckpt.save(layout, ckpt.Progress(step=2), [])
    assert ckpt.load(layout, 2)[0].step == 2
    (path / "buffer.json").write_text(damage)
    with pytest.raises(UserError, match=rf"orchestrator checkpoint {path} is corrupted .* resume from another step"):
        ckpt.load(layout, 2)
