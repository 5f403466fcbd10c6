"""A collective that fails because another rank went away is told apart from a bug: one line naming the peer."""

import torch.distributed as dist

from asyncrl.trainer.dist import peer_lost

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.81.101.2]:7331: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
    "Check the logs of the remote worker before reporting an error. GLHF!"
)


def test_a_lost_gloo_peer_is_named_in_one_line():
    assert peer_lost(RuntimeError(GLOO)) == "Read error [10.81.101.2]:7331: Connection reset by peer"
    assert peer_lost(dist.DistBackendError("NCCL communicator was aborted on rank 1.")) == (
        "NCCL communicator was aborted on rank 1."
    )


def test_other_errors_are_not_a_lost_peer():
    assert peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert peer_lost(ValueError("bad batch")) is None
