"""The case type of the conformance suite: :class:`Case`, one batch described by its mode, requests and layer."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, replace

import torch

from hal.batch import ForwardMode
from hal.config import AttentionConfig
from hal.declaration import REQUEST_TABLES
from hal.errors import ConfigError, expect
from hal.kv_dtypes import COMPUTE_DTYPE_NAMES, kv_dtype
from hal.kv_layouts import TOKEN_MAJOR
from hal.kv_layouts import kv_layout as layout_row
from hal.layer import AttentionLayer

__all__ = ["Case", "LARGE_LOGITS_Q_SCALE"]

LARGE_LOGITS_Q_SCALE = 40.0  # scaled logits of ~40 std: exp() overflows float32 without the max subtracted


@dataclass(frozen=True)
class Case:
    """One conformance batch. ``requests``: ``(cached prefix, new tokens)`` per request.

    ``layer_num`` layers of pool, each with its own noise, for the model's layers
    ``start_layer ..`` (a pipeline stage); the forward runs on layer ``layer_id`` (a model
    layer id, so ``>= start_layer``). ``sweep``: run at every page size the backend declares
    (the other cases run at their own page size, or the declared one nearest to it).
    ``slots``: ``"aligned"`` puts token ``i`` of a request at offset ``i % page_size`` of its
    (shuffled) pages; ``"scattered"`` puts every token at a random slot past page 0, as a
    page-size-1 allocator would (a backend that ``requires_page_aligned_slots`` must refuse
    it). ``threads``: host threads the forward runs with (pins the thread-count-dependent
    choices of CPU kernels, so every task shape runs on any machine). ``table``: the request table the batch
    carries, ``"token"`` (``req_to_token``, SGLang's form) or ``"page"`` (a block table ``req_to_page`` only,
    vLLM's; aligned slots). ``kv_layout``: the KV pool's layout (:mod:`hal.kv_layouts`), the same contents slot for
    slot in any of them.
    """

    name: str
    mode: ForwardMode
    requests: tuple[tuple[int, int], ...]
    tp_q_head_num: int = 4
    tp_k_head_num: int = 2
    head_dim: int = 64  # FlashInfer compiles 64/128/256 only
    v_head_dim: int | None = None
    dtype: torch.dtype = torch.float32
    page_size: int = 1
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    attn_type: str = "decoder"
    q_scale: float = 1.0  # larger queries make the logit cap matter
    blind_row: bool = False  # TARGET_VERIFY: each request's first draft token sees no key (outputs zeros)
    seed: int = 0
    scaling: float | None = None  # None: head_dim ** -0.5
    layer_num: int = 1
    layer_id: int = 0
    sweep: bool = False
    slots: str = "aligned"
    start_layer: int = 0
    threads: int | None = None
    # the models beyond Llama's shape (hal.conformance.cases_models)
    kv_lora_rank: int = 0  # MLA: one KV head, head_dim = kv_lora_rank + qk_rope_head_dim, an MLAKVPool
    qk_rope_head_dim: int = 0
    sinks: bool = False  # forward gets sinks= (one logit per q head)
    kv_cache_dtype: torch.dtype | None = None  # the pool's dtype when not the model dtype (fp8)
    k_scale: float | None = None
    v_scale: float | None = None
    table: str = "token"
    kv_layout: str = TOKEN_MAJOR

    def __post_init__(self):
        if not (isinstance(self.page_size, int) and self.page_size >= 1):
            raise ConfigError(f"case {self.name}: page_size = {self.page_size!r}: expected an int of at least 1")
        if not self.start_layer <= self.layer_id < self.start_layer + max(self.layer_num, 1):
            raise ConfigError(
                f"case {self.name}: layer_id {self.layer_id} is not a layer of its pool "
                f"({self.start_layer}..{self.start_layer + self.layer_num - 1})"
            )
        expect(self.table in REQUEST_TABLES, ConfigError, f"case {self.name}: table", self.table, "token or page")
        layout_row(self.kv_layout, ConfigError, f"case {self.name}: kv_layout")
        if self.kv_layout != TOKEN_MAJOR and self.kv_lora_rank:
            raise ConfigError(f"case {self.name}: an MLA pool is token-major (kv_layout {self.kv_layout!r})")
        if self.table == "page" and self.slots != "aligned":
            raise ConfigError(f"case {self.name}: a block table (table='page') holds page-aligned slots only")

    @property
    def id(self) -> str:
        return self.name

    @property
    def family(self) -> str:
        """The feature this case is about, for coverage reports (the first that applies)."""
        if self.kv_lora_rank:
            return "mla"
        if self.kv_layout != TOKEN_MAJOR:
            return "kv_layout"
        if self.table != "token":
            return "page_table"
        if self.sinks:
            return "sinks"
        if self.kv_cache_dtype is not None:
            return "fp8_kv"
        if self.slots != "aligned":
            return "misaligned_slots"
        if self.start_layer:
            return "start_layer"
        if self.attn_type != "decoder" and self.sliding_window_size >= 0:
            return "non_causal_window"
        if self.attn_type != "decoder":
            return "non_causal"
        if self.sliding_window_size >= 0:
            return "window"
        if self.logit_cap > 0:
            return "logit_cap"
        if self.q_scale >= LARGE_LOGITS_Q_SCALE:
            return "large_logits"
        if self.layer_num > 1:
            return "multi_layer"
        if self.scaling is not None:
            return "scaling"
        if self.v_head_dim not in (None, self.head_dim):
            return "v_head_dim"
        if self.head_dim != 64:
            return "head_dim"
        if self.threads is not None:
            return "task_shape"
        if (self.tp_q_head_num, self.tp_k_head_num) != (4, 2):
            return "gqa"
        if self.blind_row:
            return "verify_tree"
        if len(self.requests) == 1:
            return "batch1"
        if self.sweep:
            return "page_boundaries"
        return "paged" if self.page_size > 1 else "basic"

    @property
    def dtype_name(self) -> str:
        return COMPUTE_DTYPE_NAMES[self.dtype]

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache's dtype name: ``kv_cache_dtype``'s, else the model dtype's."""
        return self.dtype_name if self.kv_cache_dtype is None else kv_dtype(self.kv_cache_dtype).name

    def at_page(self, page_size: int) -> Case:
        """This case at another page size, named for the size it runs at (``decode_page16`` at 32:
        ``decode_page32``; a name without a page size gains ``_pageN``)."""
        if page_size == self.page_size:
            return self
        base = self.name.split("@")[0]
        named = re.sub(r"_page\d+", f"_page{page_size}", base) if re.search(r"_page\d+", base) else None
        return replace(self, page_size=page_size, name=named or f"{base}_page{page_size}")

    def layer(self, layer_id: int | None = None) -> AttentionLayer:
        return AttentionLayer(
            layer_id=self.layer_id if layer_id is None else layer_id,
            tp_q_head_num=self.tp_q_head_num,
            tp_k_head_num=self.tp_k_head_num,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            scaling=self.scaling,
            logit_cap=self.logit_cap,
            sliding_window_size=self.sliding_window_size,
            attn_type=self.attn_type,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def config(self, graph: bool = False) -> AttentionConfig:
        return AttentionConfig(
            tp_q_head_num=self.tp_q_head_num,
            tp_k_head_num=self.tp_k_head_num,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            dtype=self.dtype,
            page_size=self.page_size,
            sliding_window_size=self.sliding_window_size,
            logit_cap=self.logit_cap,
            non_causal=self.attn_type != "decoder",
            custom_mask=self.mode.is_target_verify(),
            graph=graph,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            attention_sinks=self.sinks,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_layout=None if self.kv_layout == TOKEN_MAJOR else self.kv_layout,
        )

    def source(self) -> str:
        """Python that rebuilds this case (``from hal.conformance.cases import *``): a reproducible example."""
        args = [repr(self.name), f"ForwardMode.{self.mode.name}", repr(self.requests)]
        for f in dataclasses.fields(self)[3:]:
            value = getattr(self, f.name)
            if value != f.default:
                text = f"torch.{str(value).split('.')[-1]}" if isinstance(value, torch.dtype) else repr(value)
                args.append(f"{f.name}={text}")
        return f"Case({', '.join(args)})"
