"""The public API is itself under test: `__all__` is pinned and importable, and the
library never imports the service."""

from __future__ import annotations

import subprocess
import sys

import trajectory
import trajectory.codec


def test_trajectory_all_is_pinned() -> None:
    assert trajectory.__all__ == sorted(trajectory.__all__, key=lambda n: (n[0].islower(), n))
    assert set(trajectory.__all__) == {
        "Branch", "BranchError", "CheckpointError", "CodecError", "Expectations", "ExportError",
        "GenerationLike", "InvariantError", "LinearTrajectory", "Plan", "TemplateNotSupported",
        "TokenBuffer", "TrajectoryError", "TrajectoryTree", "TurnRecord", "ValidGeneration",
        "ValidationError", "WeightSpan", "WeightVersion", "from_dict", "from_npz_bytes",
        "reconcile", "to_dict", "to_npz_bytes", "validate_generation",
        # training samples (trajectory.samples, trajectory.sample_formats)
        "PICKERS", "Sample", "SampleError", "build_samples", "register_picker",
        "samples_to_json", "samples_to_npz", "samples_to_safetensors",
        "load_samples_json", "load_samples_npz", "load_samples_safetensors",
        # the shared-prefix export's lines, matching against the whole tree
        "Attachment", "attach", "branch_line",
    }
    for name in trajectory.__all__ + trajectory.codec.__all__:
        assert getattr(trajectory, name, None) is not None or getattr(trajectory.codec, name, None) is not None


def test_library_never_imports_the_service() -> None:
    code = ("import sys, trajectory, trajectory.codec, trajectory.export, trajectory.validate, "
            "trajectory.samples, trajectory.sample_formats; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('session_server', 'aiohttp', 'fastapi', 'httpx')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
