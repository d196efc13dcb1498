"""The torch backend's per-token log-probabilities and entropy (``distributed.token_log_probs``)
against torch's own log-softmax in float64: values, gradients, chunks, and what the backward
keeps. The split-vocabulary path runs on two gloo ranks in ``test_tp.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from backends.torch_backend import distributed as D  # noqa: E402


def _reference(logits, targets, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return (logp.gather(-1, targets[..., None]).squeeze(-1),
            -(logp.exp() * logp).sum(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [D.LOGIT_CHUNK, 7])      # one chunk; 1 row a chunk
def test_values_and_gradients_are_the_log_softmaxs(monkeypatch, temperature, chunk):
    monkeypatch.setattr(D, "LOGIT_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    lp, ent = D.token_log_probs(logits, targets, temperature)
    want_lp, want_ent = _reference(logits.detach(), targets, temperature)
    # float32 inside: a rounding of each of the vocabulary's terms summed, each at most
    # the largest scaled logit (and its exponential's share, at most 1), twice over
    tol = 2 * 11 * 2.0 ** -23 * (1 + float(logits.detach().abs().max()) / temperature)
    assert torch.allclose(lp.double(), want_lp, atol=tol)
    assert torch.allclose(ent.double(), want_ent, atol=tol)
    w = torch.randn(2, 5, generator=gen, dtype=torch.float64)

    def loss(x):
        a, b = D.token_log_probs(x, targets, temperature)
        return (a.double() * w).sum() + (b.double() * w.flip(0)).sum()

    def loss_ref(x):
        a, b = _reference(x, targets, temperature)
        return (a * w).sum() + (b * w.flip(0)).sum()

    got, = torch.autograd.grad(loss(logits), logits)
    want, = torch.autograd.grad(loss_ref(logits), logits)
    # each gradient element: the two weights' terms, each within tol, over T
    assert torch.allclose(got, want, atol=2 * tol * float(w.abs().max()) / temperature)


def test_the_backward_keeps_the_logits_once_and_a_few_numbers_a_position():
    """What autograd saves: the logits themselves (no float32 copy, no log-softmax, no
    exponentials) and per position an index, a flag and two float32 numbers."""
    n, vocab = 6, 1000
    logits = torch.randn(n, vocab, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = D.token_log_probs(logits * 1, torch.zeros(n, dtype=torch.long))
    held = sum(t.numel() * t.element_size() for t in saved)
    assert held == n * vocab * 2 + n * (8 + 1 + 4 + 4)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16


def test_owned_logits_take_their_own_gradient_once():
    """``own``: the backward writes the gradient over the logits (one logits-sized tensor in
    a train step) and equals the gradient made beside them; a second backward is refused."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, 13, generator=gen)
    targets = torch.randint(0, 13, (3, 4), generator=gen)
    grads = []
    for own in (False, True):
        x = base.clone().requires_grad_()
        logits = x * 2                         # made here, read by nothing else
        lp, ent = D.token_log_probs(logits, targets, 0.8, own=own)
        seen = []
        logits.register_hook(lambda g, seen=seen: seen.append(g.data_ptr()) or g)
        (lp.sum() - 0.1 * ent.sum()).backward(retain_graph=True)
        grads.append(x.grad.clone())
        assert (seen[0] == logits.data_ptr()) == own
        if own:
            with pytest.raises(RuntimeError, match="runs once"):
                (lp.sum() - 0.1 * ent.sum()).backward()
    assert torch.equal(grads[0], grads[1])
