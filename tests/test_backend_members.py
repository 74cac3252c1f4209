"""SGLang 0.5.21's additions to the backend contract live with the SGLang integration
(``hal.integrations.sglang_members``), not in ``hal.AttentionBackend``, whose members are the seed's; the old
access through a hal backend (deprecated in 0.3.0, with a warning naming the new place) is gone in 0.4.0."""

from __future__ import annotations

import pytest

from hal.backend import AttentionBackend
from hal.batch import ForwardMode, SharedReadEnds
from hal.capability import DeviceCapability
from hal.errors import UnsupportedError
from hal.integrations.sglang_members import DECLARED, MEMBERS, SGLangMembers, sglang_members

CPU = DeviceCapability(type="cpu", available=True, dtypes=("fp32", "bf16"))


class Plain(AttentionBackend):
    name = "plain"


class NoGraphs(AttentionBackend):
    name = "no_graphs"
    supports_graph = False


class Audited(SGLangMembers, AttentionBackend):
    """A backend that answers one of the questions itself."""

    name = "audited"

    def shared_read_ends(self, forward_mode):
        return SharedReadEnds.PRE_REPLAY if forward_mode.is_decode() else SharedReadEnds.UNKNOWN


def test_the_core_holds_none_of_the_later_releases_members():
    assert MEMBERS >= {"shared_read_ends", "verify_mask", "data_type", "kv_cache_dtype", "attn_backend_list"}
    assert MEMBERS >= set(DECLARED)
    assert not [name for name in MEMBERS if hasattr(AttentionBackend, name)]


def test_hals_answers_come_from_the_mixin():
    members = sglang_members(Plain(CPU))
    assert members.shared_read_ends(ForwardMode.DECODE) is SharedReadEnds.UNKNOWN
    assert members.verify_mask is None and members.draft_extend_metadata_captured_in_graph() is False
    assert all(getattr(members, name) is False for name in DECLARED)
    assert members.data_type is None and members.kv_index_translator is None
    members.validate_elastic_cuda_graph_recapture()  # Plain declares graphs
    with pytest.raises(UnsupportedError, match="no_graphs does not capture graphs"):
        sglang_members(NoGraphs(CPU)).validate_elastic_cuda_graph_recapture()
    with pytest.raises(UnsupportedError, match="plain: chunked-prefix"):
        members.prepare_full_cuda_graph_chunked_prefix(None, in_capture=True)


def test_a_backend_inheriting_the_mixin_answers_itself():
    backend = Audited(CPU)
    assert sglang_members(backend) is backend
    assert backend.shared_read_ends(ForwardMode.DECODE) is SharedReadEnds.PRE_REPLAY
    assert backend.verify_mask is None


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_the_old_access_through_a_backend_is_gone(name):
    """Deprecated in 0.3.0 (a warning naming the new place), removed in 0.4.0 as announced."""
    assert not hasattr(Plain(CPU), name)
    getattr(sglang_members(Plain(CPU)), name)


def test_other_missing_attributes_are_still_attribute_errors():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        Plain(CPU).nothing_here  # noqa: B018


def test_the_class_shows_at_most_40_public_names_each_in_a_group_of_its_docstring():
    """What an engine calls, what a port implements, the declaration and the two helper objects: nothing else."""
    names = sorted(n for n in dir(AttentionBackend) if not n.startswith("_"))
    assert len(names) <= 40, names
    doc = AttentionBackend.__doc__
    assert not [n for n in names if f"``{n}``" not in doc and f":meth:`{n}`" not in doc], "name its group"


@pytest.mark.parametrize(
    ("old", "owner", "new"),
    [
        ("set_forward_metadata", "plan", "set_metadata"),
        ("metadata_for", "plan", "metadata_for"),
        ("is_graph_batch", "plan", "is_graph_batch"),
        ("check_batch", "plan", "check_batch"),
        ("planned_path", "plan", "path"),
        ("helper_ops", "steps", "helper_ops"),
        ("forward_paths", "steps", "forward_paths"),
        ("prepare_forward", "steps", "prepare_forward"),
        ("new_kv_from_cache", "steps", "new_kv_from_cache"),
        ("check_model_features", "steps", "check_model_features"),
        ("check_input_dtypes", "steps", "check_input_dtypes"),
    ],
)
def test_a_helper_that_moved_still_answers_on_an_instance_naming_its_new_place(old, owner, new):
    backend = Plain(CPU)
    assert not hasattr(AttentionBackend, old)
    with pytest.warns(DeprecationWarning, match=rf"backend\.{owner}\.{new}"):
        moved = getattr(backend, old)
    assert moved == getattr(getattr(backend, owner), new)


def test_a_declared_attribute_read_off_an_instance_answers_from_the_declaration():
    """A class that sets none reads the field's default, as the base class's attribute of hal 0.3 answered."""
    backend = Plain(CPU)
    with pytest.warns(DeprecationWarning, match=r"declaration\(\)\.supports_graph"):
        assert backend.supports_graph is True
    assert NoGraphs(CPU).supports_graph is False  # a class attribute of its own: the port's input, as it wrote it
    assert not hasattr(AttentionBackend, "supports_graph")


def test_the_base_class_carries_no_compatibility_code():
    """Older plugin APIs are adapted at the door (hal.plugin_compat): no class-creation hook on the base classes, no
    per-call context variable in the forward path, none of 0.1's deprecated members."""
    import inspect

    import hal.backend
    import hal.prologue

    assert not [k.__name__ for k in AttentionBackend.__mro__[:-1] if "__init_subclass__" in k.__dict__]
    assert not hasattr(AttentionBackend, "available") and not hasattr(AttentionBackend, "validate")
    assert "ContextVar" not in inspect.getsource(hal.backend)
    assert "contextvars" not in inspect.getsource(AttentionBackend._forward)


def test_a_port_of_its_own_plan_or_steps_member_changes_nothing_of_hal():
    """A 0.3 port may have named a member ``plan`` or ``steps`` (FlashInfer's wrappers have a ``plan()``): hal's edges
    and the old helper names read hal's own objects, so such a port runs as before."""
    import torch

    from hal.conformance.cases import CASES, build

    class OwnNames(AttentionBackend):
        name = "own_names"
        steps = ("its", "own")

        def plan(self):
            return "its own plan"

        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            self.set_forward_metadata(None, fb)  # plugin API 3's spelling

        def run_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            return torch.zeros(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    built = build(next(c for c in CASES if c.mode is ForwardMode.DECODE))
    backend = OwnNames(CPU)
    with pytest.warns(DeprecationWarning):
        backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert out.shape == built.expected.shape and backend.plan() == "its own plan" and backend.steps == ("its", "own")
