"""Host synchronisation is judged on the path that runs under capture.

A forward that synchronises there is a :class:`CaptureError` naming the file and line of the
synchronising call, and leaves nothing behind: no capture open, the random generator usable,
the next prepare working.  A forward that synchronises only when no stream is capturing (as
transformers' mask code does, asking ``torch.cuda.is_current_stream_capturing()``) is captured.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


class ReadsAScalar(torch.nn.Module):
    def forward(self, x):
        return x * float(x.sum().item())  # synchronises: item


class CopiesToTheHost(torch.nn.Module):
    def forward(self, x):
        total = x.sum().cpu()  # synchronises: cpu
        return x * total.to(x.device)


class FindsNonzeros(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x > 0).float()  # synchronises: nonzero


class BranchesOnATensor(torch.nn.Module):
    def forward(self, x):
        if (x > 0).all():  # synchronises: if
            return x * 2
        return x - 1


class ChecksOnlyWhenNotCapturing(torch.nn.Module):
    """Synchronises eagerly and skips the check under capture, as transformers' masks do."""

    def forward(self, x):
        if not torch.cuda.is_current_stream_capturing() and bool((x == 0).all()):
            return x
        return torch.relu(x) * 2


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(marker))


@pytest.mark.parametrize("model_class,what", [(ReadsAScalar, "item"), (CopiesToTheHost, "cpu"),
                                              (FindsNonzeros, "nonzero"),
                                              (BranchesOnATensor, "if")])
def test_a_forward_that_synchronises_under_capture_is_refused_naming_its_line(model_class, what):
    import nimble
    from nimble.errors import CaptureError

    x = torch.randn(64, device="cuda")
    with pytest.raises(CaptureError) as info:
        nimble.Nimble(model_class().cuda().eval()).prepare(x)
    message = str(info.value)
    line = _line_of(f"# synchronises: {what}")
    assert f"{Path(__file__).name}:{line} (in forward): " in message, message
    assert f"of {model_class.__name__} cannot be captured into a CUDA graph: " in message
    if model_class is not FindsNonzeros:  # a torch may refuse nonzero under capture itself
        assert "cannot be captured into a CUDA graph: it synchronises with the host at " \
            in message
    # nothing half-done: no capture open, the generator usable, the next prepare working
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.randn(4, device="cuda").isfinite().all()
    relu = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).cuda().eval()
    nm = nimble.Nimble(relu).prepare(x.view(1, 64), options=nimble.PrepareOptions(relaunches=4))
    with torch.no_grad():
        torch.testing.assert_close(nm(x.view(1, 64)), relu(x.view(1, 64)), rtol=1e-4, atol=1e-4)
    nm.close()


def test_a_forward_that_synchronises_only_outside_capture_is_captured():
    import nimble

    model = ChecksOnlyWhenNotCapturing().cuda().eval()
    x = torch.randn(64, device="cuda")
    nm = nimble.Nimble(model).prepare(x)
    assert not nm.graph.meta["verified"]["not_bitwise"]
    fresh = torch.randn_like(x)
    with torch.no_grad():
        assert torch.equal(nm(fresh), model(fresh))
    nm.close()
