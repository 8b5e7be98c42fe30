"""Every derived form of every mask mode against its element-wise mask_mod, evaluated densely on random layouts.

The mask_mod is the one definition; block occupancy (flex), the dense backend's key ranges, the varlen backend's
spans and the attended-pair count (MFU) are derived from it by `MaskMode`, and each must agree exactly on random
document layouts, windows and row lengths (multiples of the block and not). A prefix-LM inner mask written in
document-local coordinates shows the document wrapper handing local positions to any inner mask.
"""

from dataclasses import dataclass

import pytest
import torch

from flexengine.surgery.attention.block_mask import _create_block_mask, build_block_mask, dense_mask_from_mod
from flexengine.surgery.attention.mask_mode import MaskMode, canonical_document_ids, mask_mode
from flexengine.surgery.attention.masks import MODES, InnerMask
from flexengine.surgery.attention.varlen import _band_mask, _call_shapes

BLOCK = 128


@dataclass(frozen=True)
class PrefixLM(InnerMask):
    """Test-only inner mask: the first `prefix` tokens of each document see each other both ways, the rest is
    causal. Not shift-invariant: it is only right if the wrapper hands it document-local positions."""

    prefix: int

    @property
    def name(self) -> str:
        return f"prefix_lm_{self.prefix}"

    def allowed(self, q, kv):
        return (kv <= q) | ((q < self.prefix) & (kv < self.prefix))

    def key_interval(self, q):
        return torch.zeros_like(q), q.clamp(min=self.prefix - 1)


def _plan_mask(plan: torch.Tensor, B: int, S: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, S] bool: the (query, key) pairs the varlen plan's kernel calls attend, and [B, S] int: how many spans
    cover each query (checked against the mask_mod: exactly once, and the same pairs)."""
    pairs = torch.zeros(B, S, S, dtype=torch.bool)
    covered = torch.zeros(B, S, dtype=torch.int64)
    for kind, row, start, length in plan.tolist():
        k_off, k_len, causal = _call_shapes(kind, length, window)
        if causal:  # SDPA's is_causal on a square call: top-left aligned
            allowed = torch.ones(length, k_len, dtype=torch.bool).tril()
        else:
            allowed = _band_mask(length, window, torch.float32, torch.device("cpu")) == 0
        pairs[row, start : start + length, start + k_off : start + k_off + k_len] |= allowed
        covered[row, start : start + length] += 1
    return pairs, covered


def _random_lengths(seq_len: int, g: torch.Generator) -> list[int]:
    """Document lengths filling a row: 1-token documents, short ones, ones across blocks, a whole row."""
    lengths, total = [], 0
    while total < seq_len:
        kind = int(torch.randint(0, 5, (1,), generator=g))
        n = [1, int(torch.randint(2, 40, (1,), generator=g)), int(torch.randint(100, 300, (1,), generator=g)), seq_len][
            min(kind, 3)
        ]
        lengths.append(min(n, seq_len - total))
        total += lengths[-1]
    return lengths


def _ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def _cases():
    """(mode, document lengths per row) on random layouts: every MODES entry, windows from 1 to past the row."""
    g = torch.Generator().manual_seed(21)
    cases = []
    for seq_len in [256, 384, 300, 129, 200, 127]:  # block multiples and ragged
        rows = [_random_lengths(seq_len, g) for _ in range(3)]
        window = int(torch.randint(1, seq_len + 50, (1,), generator=g))
        for name in MODES:
            cases.append(pytest.param(mask_mode(name, window), rows, id=f"{name}-w{window}-S{seq_len}"))
        prefix = int(torch.randint(1, 200, (1,), generator=g))
        for documents in (True, False):
            cases.append(
                pytest.param(MaskMode(PrefixLM(prefix), documents), rows, id=f"prefix{prefix}-{documents}-S{seq_len}")
            )
    return cases


def _dense(mode: MaskMode, ids: torch.Tensor) -> torch.Tensor:
    """The mask_mod on every (q, kv) pair: [B, S, S] bool (the reference every form is checked against)."""
    B, S = ids.shape
    return dense_mask_from_mod(mode.mask_mod(ids), B, range(S), range(S), ids.device)[:, 0]


def _brute_force(mode: MaskMode, rows: list[list[int]]) -> torch.Tensor:
    """The definition, document by document: same document and the inner mask on local positions."""
    S = sum(rows[0])
    out = torch.zeros(len(rows), S, S, dtype=torch.bool)
    for b, lengths in enumerate(rows):
        for start, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths if mode.documents else [S]):
            local = torch.arange(n)
            out[b, start : start + n, start : start + n] = mode.inner.allowed(local[:, None], local[None, :])
    return out


@pytest.mark.parametrize("mode, rows", _cases())
def test_every_form_matches_the_mask_mod(mode, rows):
    ids = canonical_document_ids(_ids(rows))
    B, S = ids.shape
    dense = _dense(mode, ids)
    assert torch.equal(dense, _brute_force(mode, rows)), "mask_mod != its definition in local coordinates"

    # block occupancy: a block may attend iff any pair does, entirely iff every pair does (no padding inside)
    n = -(-S // BLOCK)
    padded = torch.zeros(B, n * BLOCK, n * BLOCK, dtype=torch.bool)
    padded[:, :S, :S] = dense
    tiles = padded.view(B, n, BLOCK, n, BLOCK)
    real = torch.zeros(n * BLOCK, dtype=torch.bool)
    real[:S] = True
    real = real.view(n, BLOCK).all(-1)
    some, every = mode.block_occupancy(ids, BLOCK)
    assert torch.equal(some, tiles.any(4).any(2)), "block occupancy: some pair"
    assert torch.equal(every, tiles.all(4).all(2) & real[:, None] & real[None, :]), "block occupancy: every pair"

    # the dense backend's key range per query chunk is exactly the span of keys its queries see
    chunk = int(torch.randint(1, S + 1, (1,), generator=torch.Generator().manual_seed(S)))
    for q_start, kv_start, kv_end in mode.key_ranges(ids, chunk):
        keys = dense[:, q_start : q_start + chunk].any(1).any(0).nonzero()[:, 0]
        assert (kv_start, kv_end) == (int(keys[0]), int(keys[-1]) + 1), f"chunk at {q_start}"

    # attended pairs (model FLOPs) count exactly the allowed pairs
    lengths = [n for r in rows for n in r] if mode.documents else [S] * B
    assert mode.attended_pairs(lengths) == int(dense.sum())

    # varlen: its kernel calls cover each query once and attend exactly the allowed pairs (or it refuses)
    if mode.inner.varlen_window is None:
        with pytest.raises(NotImplementedError, match="varlen"):
            _ = mode.varlen_window
        return
    pairs, covered = _plan_mask(mode.varlen_spans(ids), B, S, mode.varlen_window)
    assert bool((covered == 1).all()), "varlen spans: every query exactly once"
    assert torch.equal(pairs, dense), "varlen spans"


@pytest.mark.parametrize("mode, rows", [c for c in _cases() if "S3" in c.id or "S1" in c.id][::3])
def test_block_mask_equals_torch_create_block_mask(mode, rows):
    """The block-level BlockMask (from_kv_blocks, O((S/128)^2)) is torch's element-wise one, full blocks too,
    on ragged rows as well (torch masks the padding past S)."""
    ids = canonical_document_ids(_ids(rows))
    B, S = ids.shape
    ours = build_block_mask(mode, ids, BLOCK)
    torch_built = _create_block_mask(mode.mask_mod(ids), B, S, ids.device, BLOCK)
    assert torch.equal(ours.to_dense(), torch_built.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, torch_built.full_kv_num_blocks)


def test_an_inner_mask_in_local_coordinates_runs_packed_exactly_as_each_document_alone():
    """Per-document prefix-LM through the document wrapper: a packed row (dense backend, chunked so that key
    ranges matter) gives each document what it gets alone in a row of its own."""
    from flexengine.surgery.attention.block_mask import build_batch_mask
    from flexengine.surgery.attention.patch import LayerMasks, flexengine_attention
    from flexengine.surgery.attention.spec import AttentionSpec, AttnBackend

    g = torch.Generator().manual_seed(0)
    lengths = [37, 5, 90, 1, 60]
    S, H, D = sum(lengths), 2, 8
    q, k, v = (torch.randn(1, H, S, D, generator=g) for _ in range(3))
    spec = AttentionSpec("packed_doc", AttnBackend.DENSE, (None,), (None,), "test")

    def attend(mode, ids, q, k, v):
        mask = build_batch_mask(ids, mode=mode, backend=AttnBackend.DENSE, dense_chunk=16)
        return flexengine_attention(None, q, k, v, None, scaling=0.3, flexengine_mask=LayerMasks(spec, {None: mask}))[0]

    inner = PrefixLM(20)
    packed = attend(MaskMode(inner, True), _ids([lengths]), q, k, v)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = attend(
            MaskMode(inner, False), torch.zeros(1, n, dtype=torch.long), q[:, :, part], k[:, :, part], v[:, :, part]
        )
        torch.testing.assert_close(packed[:, part], alone, atol=1e-6, rtol=0)
        start += n
    # the same inner mask on row positions (no local coordinates) would not: the wrapper really hands them over
    ids = _ids([lengths])
    row_positions = _dense(MaskMode(inner, False), ids) & (ids[:, :, None] == ids[:, None, :])
    assert not torch.equal(row_positions, _dense(MaskMode(inner, True), ids))


@pytest.mark.parametrize("name", [*MODES, "prefix_lm"])
def test_flex_on_a_ragged_row_equals_the_dense_reference(name):
    """Rows that are no multiple of the block also take the block-level BlockMask (torch masks the padding); the
    prefix-LM runs flex's element-wise path with document-local positions."""
    from flexengine.surgery.attention.block_mask import build_batch_mask
    from flexengine.surgery.attention.patch import LayerMasks, flexengine_attention
    from flexengine.surgery.attention.spec import AttentionSpec, AttnBackend

    g = torch.Generator().manual_seed(1)
    ids = _ids([[70, 1, 150, 79], [300]])
    q, k, v = (torch.randn(2, 2, 300, 8, generator=g) for _ in range(3))
    outs = []
    for backend in (AttnBackend.FLEX, AttnBackend.DENSE):
        spec = AttentionSpec("packed_doc", backend, (None,), (None,), "test", compile=False)
        mode = MaskMode(PrefixLM(100), True) if name == "prefix_lm" else mask_mode(name, 90)
        mask = build_batch_mask(ids, mode=mode, backend=backend, dense_chunk=64)
        outs.append(
            flexengine_attention(None, q, k, v, None, scaling=0.3, flexengine_mask=LayerMasks(spec, {None: mask}))[0]
        )
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)


def test_the_mode_table_and_the_shipped_attn_configs_name_the_same_modes():
    """A mode is its MODES entry plus conf/attn/<name>.yaml; nothing else lists modes."""
    import yaml

    from flexengine.core.config import conf_dir

    shipped = {p.stem: yaml.safe_load(p.read_text())["mode"] for p in (conf_dir() / "attn").glob("*.yaml")}
    assert all(stem == mode for stem, mode in shipped.items()), shipped
    assert set(shipped) == set(MODES)


def test_a_new_mode_is_one_table_entry(monkeypatch, tmp_path):
    """A packed prefix-LM added to MODES alone composes, passes the job rules and resolves to its mask
    (the config schemas hold no mode list); an unknown mode is refused at composition naming attn.mode."""
    from flexengine.core.errors import UserError
    from flexengine.surgery.attention import masks
    from flexengine.surgery.attention.spec import resolve_attention_spec
    from tests.helpers import make_job, make_llama

    monkeypatch.setitem(masks.MODES, "packed_prefix_lm", masks.ModeEntry(True, False, lambda window: PrefixLM(16)))
    job = make_job(tmp_path, "attn.mode=packed_prefix_lm", "attn.backend=dense")
    assert job.data.packing == "bfd"  # resolved from the entry: it packs documents
    spec = resolve_attention_spec(job.attn, make_llama().config)
    assert spec.documents and spec.layer_masks[0] == MaskMode(PrefixLM(16), True)
    with pytest.raises(UserError, match="attn.mode.*packed_doc"):
        make_job(tmp_path, "attn.mode=prefix_lm_typo")


def test_a_per_document_mask_mod_without_document_ids_is_refused_and_a_per_row_one_needs_none():
    with pytest.raises(ValueError, match="needs the document ids"):
        mask_mode("packed_doc").mask_mod(None)
    allowed = mask_mode("causal").mask_mod(None)
    i = torch.arange(3)
    assert allowed(i, i, i[:, None], i[None, :]).equal(torch.ones(3, 3, dtype=torch.bool).tril())
