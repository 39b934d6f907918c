"""workers/cpu_weights.py: float32 CPU linears re-laid input-major keep their values and results."""

import torch
from torch import nn

from meshserve.workers.cpu_weights import InputMajorLinear, input_major_linears


class _Tiny(nn.Module):
    """An embedding with a tied LM head, two float32 linears (one with a bias), one bfloat16 linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.up = nn.Linear(16, 40)
        self.down = nn.Linear(40, 16, bias=False)
        self.bf16 = nn.Linear(16, 16, bias=False).to(torch.bfloat16)
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.down(torch.relu(self.up(self.embed(ids)))))


def _float64_forward(model: _Tiny, ids: torch.Tensor) -> torch.Tensor:
    x = model.embed.weight.double()[ids]
    x = torch.relu(x @ model.up.weight.double().T + model.up.bias.double())
    return x @ model.down.weight.double().T @ model.lm_head.weight.double().T


def test_weights_keep_their_values_and_shape_in_input_major_storage():
    torch.manual_seed(0)
    model = _Tiny()
    before = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    assert input_major_linears(model) == 3  # up, down, lm_head; not the bfloat16 one
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p, before[name]), name  # same values, same [out, in] shape
    for linear in (model.up, model.down, model.lm_head):
        assert isinstance(linear, InputMajorLinear)
        assert linear.weight_t.is_contiguous() and linear.weight_t.data_ptr() == linear.weight.data_ptr()
        assert not linear.weight.requires_grad
    assert model.up.bias is not None and model.down.bias is None
    assert model.bf16.weight.is_contiguous()  # bfloat16: left as it was
    assert model.embed.weight.is_contiguous()  # the embedding keeps its rows
    assert model.lm_head.weight.data_ptr() != model.embed.weight.data_ptr()  # a tied head gets its own copy
    assert input_major_linears(model) == 0  # idempotent


def test_outputs_match_the_float64_oracle_and_the_row_major_model():
    torch.manual_seed(1)
    model = _Tiny()
    ids = torch.randint(0, 50, (64,))
    with torch.inference_mode():
        before = model(ids)
        input_major_linears(model)
        after = model(ids)
    torch.testing.assert_close(after.double(), _float64_forward(model, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_inputs_of_any_rank_take_the_same_product():
    """2-D inputs go through torch.mm / addmm on the [in, out] tensor, others through F.linear:
    both are F.linear's result on the original layer, bit for bit."""
    torch.manual_seed(2)
    for bias in (True, False):
        plain = nn.Linear(24, 40, bias=bias)
        swapped = InputMajorLinear(plain)
        for shape in ((7, 24), (3, 5, 24), (24,)):
            x = torch.randn(*shape)
            with torch.inference_mode():
                assert torch.equal(swapped(x), nn.functional.linear(x, plain.weight.t().contiguous().t(), plain.bias))
                torch.testing.assert_close(swapped(x), plain(x), atol=1e-6, rtol=1e-6)


def test_from_two_rows_onednn_takes_the_product_on_its_packed_copy(monkeypatch):
    """Rows >= ONEDNN_MIN_ROWS go to oneDNN on the blocked copy of the weight (float64 oracle,
    1e-5 relative), one row to torch.mm; with onednn=False every size takes torch.mm."""
    import pytest

    from meshserve.workers import cpu_weights

    if not cpu_weights.onednn_available():
        pytest.skip("torch built without oneDNN: the MKL path serves every size")
    calls = []
    real = cpu_weights.onednn_linear

    def spy(x, weight, bias):
        calls.append((x.shape[0], weight.is_mkldnn))
        return real(x, weight, bias)

    monkeypatch.setattr(cpu_weights, "onednn_linear", spy)
    torch.manual_seed(4)
    for bias in (True, False):
        plain = nn.Linear(96, 136, bias=bias)
        swapped, mkl_only = InputMajorLinear(plain), InputMajorLinear(plain, onednn=False)
        assert mkl_only.weight_packed is None
        assert torch.equal(swapped.weight_packed.to_dense(), plain.weight)  # the same values, blocked
        w64 = plain.weight.double()
        for rows in (1, 2, 7, 64, 300):
            x = torch.randn(rows, 96)
            ref = x.double() @ w64.T + (plain.bias.double() if bias else 0)
            with torch.inference_mode():
                out = swapped(x)
                assert torch.equal(mkl_only(x), nn.functional.linear(x, swapped.weight, plain.bias))
            assert ((out.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-5, rows
    assert calls == [(2, True), (7, True), (64, True), (300, True)] * 2


def test_the_packed_copy_stays_out_of_the_state_dict():
    """Loaders and checkpoints see the [out, in] weight only, not oneDNN's opaque copy."""
    torch.manual_seed(5)
    swapped = InputMajorLinear(nn.Linear(16, 24, bias=False))
    assert list(swapped.state_dict()) == ["weight"]
    assert [name for name, _ in swapped.named_buffers()] == []


def test_blocked_copies_only_while_they_fit_the_memory_share(monkeypatch):
    """input_major_linears packs while the float32 linears' bytes stay within PACKED_MEMORY_SHARE of
    the available memory; beyond it no copy is made and oneDNN reads
    the dense storage, with the same product (float64 oracle)."""
    import pytest

    from meshserve.workers import cpu_weights

    if not cpu_weights.onednn_available():
        pytest.skip("torch built without oneDNN: nothing is packed")
    torch.manual_seed(6)
    linear_bytes = (16 * 40 + 40 * 16 + 16 * 50) * 4  # up, down, lm_head in float32
    fits = int(linear_bytes / cpu_weights.PACKED_MEMORY_SHARE) + 1
    for available, packed in ((fits, True), (fits - 8, False)):
        model = _Tiny()
        input_major_linears(model, available=available)
        assert all((m.weight_packed is not None) is packed for m in (model.up, model.down, model.lm_head))
        ids = torch.randint(0, 50, (64,))
        with torch.inference_mode():
            out = model(ids)
        torch.testing.assert_close(out.double(), _float64_forward(model, ids), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(cpu_weights, "available_host_memory", lambda: fits - 8)
    model = _Tiny()
    input_major_linears(model)  # the host's memory by default
    assert model.up.weight_packed is None and model.up.onednn
