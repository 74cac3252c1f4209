"""``hal lint``: a planted backend's host syncs, dynamic shapes and data-sized allocations are named by line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hal.commands.cli import main
from hal.commands.lint import lint_paths, lint_source

ROOT = Path(__file__).resolve().parents[1]

PLANTED = textwrap.dedent(
    """
    import torch

    from hal.backend import AttentionBackend


    class PlantedBackend(AttentionBackend):
        name = "planted"

        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            self.width = int(fb.seq_lens.max())  # host work belongs here: not reported
            self.lens = fb.seq_lens_cpu.tolist()

        def init_forward_metadata_in_graph(self, fb):
            n = fb.seq_lens.max().item()  # PLANT host-sync
            self.buf = torch.empty(int(fb.seq_lens.max()))  # PLANT host-sync data-alloc
            self.idx = torch.nonzero(fb.seq_lens > 1)  # PLANT dynamic-shape
            self.rows = fb.req_to_token[fb.seq_lens > 0]  # PLANT dynamic-shape
            self.lens = torch.tensor(self.lens)  # PLANT host-data
            self.width = n

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if forward_batch.seq_lens.any():  # PLANT host-sync
                pass
            total = float(q.sum())  # PLANT host-sync
            host = q.cpu()  # PLANT host-sync
            reps = forward_batch.seq_lens.long()
            expanded = torch.repeat_interleave(q, reps, dim=0)  # PLANT dynamic-shape
            ok = q.repeat_interleave(reps, dim=0, output_size=q.shape[0])
            same = q.repeat_interleave(2, dim=0)
            fine = q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
            return self._helper(q, forward_batch) + total + host + expanded + ok + same + fine

        def _helper(self, q, fb):
            mask = fb.seq_lens > 3
            picked = q[mask]  # PLANT dynamic-shape
            uniq = torch.unique(fb.seq_lens)  # PLANT dynamic-shape
            if torch.equal(q, q):  # PLANT host-sync
                pass
            width = int(fb.seq_lens.max())  # hal: allow-host-sync eager-only path, never captured
            # hal: allow-data-alloc sized on the line above, allowed there
            scratch = torch.zeros(width, q.shape[1])
            bad = fb.seq_lens.tolist()  # hal: allow-host-sync
            return picked + uniq + scratch + bad + _module_helper(q)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            return self.forward_decode(q, k, v, layer, forward_batch)

        def never_in_graph(self, fb):
            return fb.seq_lens.tolist()  # not reached from an in-graph method: not reported


    def _module_helper(q):
        return q.masked_select(q > 0).numpy()  # PLANT dynamic-shape host-sync
    """
)


def _planted_lines() -> dict[int, set[str]]:
    want = {}
    for number, line in enumerate(PLANTED.splitlines(), 1):
        if "# PLANT" in line:
            want[number] = set(line.split("# PLANT", 1)[1].split())
    return want


def test_planted_backend_every_finding_named_by_line_and_nothing_else():
    findings = lint_source(PLANTED, "planted.py")
    got: dict[int, set[str]] = {}
    for f in findings:
        got.setdefault(f.line, set()).add(f.tag)
    bare_allow = next(n for n, text in enumerate(PLANTED.splitlines(), 1) if text.endswith("allow-host-sync"))
    want = _planted_lines()
    want[bare_allow] = {"host-sync"}  # an allow comment without a reason does not allow
    assert got == want
    bare = next(f for f in findings if f.line == bare_allow)
    assert "needs a reason" in bare.message
    assert str(findings[0]).startswith(f"planted.py:{findings[0].line}: ")
    helper = next(f for f in findings if "torch.unique" in f.message or "unique has" in f.message)
    assert helper.function == "PlantedBackend._helper"


def test_cli_prints_file_line_and_exits_non_zero(tmp_path, capsys):
    path = tmp_path / "planted_backend.py"
    path.write_text(PLANTED)
    assert main(["lint", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith(f"{path}:")]
    bare_allow = next(n for n, text in enumerate(PLANTED.splitlines(), 1) if text.endswith("allow-host-sync"))
    assert {int(line.split(":")[1]) for line in lines} == {*_planted_lines(), bare_allow}
    assert out[-1].startswith("hal lint: ") and "finding(s) in 1 file(s)" in out[-1]


def test_clean_file_exits_zero_and_bad_paths_are_config_errors(tmp_path, capsys):
    clean = tmp_path / "clean.py"
    clean.write_text("class B:\n    def forward(self, q, k, v, layer, fb):\n        return q * 2\n")
    assert main(["lint", str(clean)]) == 0
    assert "1 file(s) clean" in capsys.readouterr().out
    assert main(["lint", str(tmp_path / "missing.py")]) == 2
    assert "expected a Python file or a directory" in capsys.readouterr().err
    broken = tmp_path / "broken.py"
    broken.write_text("def forward(:\n")
    assert main(["lint", str(broken)]) == 2
    assert "does not parse" in capsys.readouterr().err


def test_hal_own_backends_are_clean():
    """Every backend in the tree passes (or allows, with a reason) what the lint finds."""
    findings = lint_paths([str(ROOT / "devices"), str(ROOT / "kernels")])
    assert findings == [], "\n".join(map(str, findings))


@pytest.mark.parametrize(
    ("line", "tag"),
    [
        ("n = q.shape[0]\n        return torch.empty(n)", None),
        ("return torch.empty(q.size(0), q.numel())", None),
        ("return torch.arange(fb.seq_lens.max())", "data-alloc"),
        ("return torch.full((int(q[0]),), 1.0)", "host-sync data-alloc"),
        ("return q.new_zeros(q.sum().item())", "host-sync data-alloc"),
        ("return torch.where(q > 0)", "dynamic-shape"),
        ("return torch.where(q > 0, q, 0)", None),
        ('return q.to("cpu")', "host-sync"),
        ("return q if q.max() > 0 else -q", "host-sync"),
        ("return q.bool() and q", "host-sync"),
        ("return q[~(q > 0)]", "dynamic-shape"),
        ("x = fb.custom_mask\n        return x if x is not None else q", None),
        ("return q if not q.is_contiguous() and q.dim() == 3 else q", None),
        ("return q if torch.cuda.is_current_stream_capturing() else -q", None),
        ("return q if not q else -q", "host-sync"),
        ("return torch.allclose(q, q)", "host-sync"),
        ("return q if q.is_cuda or q.get_device() else q", None),
        ("parts = []\n        if not parts:\n            parts = torch.cat([q])\n        return parts", None),
        ("fb.seq_lens[0] = 0\n        return q", "host-data"),
        ("self.buf = fb.seq_lens.clone()\n        self.buf[fb.seq_lens] = 1.0\n        return q", "host-data"),
        ("fb.positions[1:] = 0\n        fb.positions[...] = 1\n        return q", None),
        ("fb.positions[0] = fb.seq_lens[1]\n        return q", None),
        ("return torch.tensor(0, device=q.device)", "host-data"),
        ("fb.positions.copy_(torch.tensor([1, 2]))\n        return q", "host-data"),
        ("fb.positions.copy_(fb.seq_lens)\n        return q", None),
    ],
)
def test_single_rules(line, tag):
    source = f"import torch\n\n\ndef forward(q, fb):\n        {line}\n"
    tags = {f.tag for f in lint_source(textwrap.dedent(source))}
    assert tags == set(tag.split() if tag else ())


def test_json_output(tmp_path, capsys):
    import json

    path = tmp_path / "planted_backend.py"
    path.write_text(PLANTED)
    assert main(["lint", "--json", str(path)]) == 1
    findings = json.loads(capsys.readouterr().out)
    assert {f["tag"] for f in findings} == {"host-sync", "dynamic-shape", "data-alloc", "host-data"}
    assert all(f["path"] == str(path) and isinstance(f["line"], int) for f in findings)


def test_lint_follows_calls_into_the_package_and_names_what_it_did_not_read(tmp_path, capsys):
    """A host sync in the kernel module next to a backend, reached from forward through ``kernels.launch`` and
    through ``from .kernels import pull``: linting the backend alone finds both in kernels.py, and names the
    modules it imports but never called into."""
    package = tmp_path / "mydev"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kernels.py").write_text(
        "def launch(q):\n    return q.sum().item()\n\n\ndef pull(q):\n    return q.tolist()\n\n\n"
        "def unused(q):\n    return q.cpu()\n"
    )
    (package / "ops.py").write_text("")
    (package / "backend.py").write_text(
        "from . import kernels\nfrom mydev.ops import *\nfrom .kernels import pull as fetch\n\n\nclass B:\n"
        "    def forward(self, q, k, v, layer, fb):\n        return kernels.launch(q)\n\n"
        "    def forward_decode(self, q, k, v, layer, fb):\n        return fetch(q)\n"
    )
    assert main(["lint", str(package / "backend.py")]) == 1
    out = capsys.readouterr().out
    assert "kernels.py:2: .item()" in out and "(in kernels.launch)" in out
    assert "kernels.py:6: .tolist()" in out and "(in kernels.pull)" in out
    assert ".cpu()" not in out, "a function no in-graph method calls is not linted"
    assert "not read: 2 module(s)" in out and all(f"{n}.py" in out for n in ("ops", "__init__"))
    assert main(["lint", str(package)]) == 1
    out = capsys.readouterr().out
    assert "not read" not in out and out.count(".item()") == 1, "a finding reached twice is reported once"
