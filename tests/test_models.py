"""Tests for the models package: every arch at 32 and 224 px, structure, registry, training."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models import create_model, list_models, register_model

NUM_CLASSES = 5
ARCHS = list_models(origin="ours")


def _convs(model: nn.Module) -> list[nn.Conv2d]:
    return [m for m in model.modules() if isinstance(m, nn.Conv2d)]


def test_registered_archs() -> None:
    assert ARCHS == ["conv11", "resnet50", "vgg11", "vgg16"]


@pytest.mark.parametrize("size", [32, 224])
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_backward(arch: str, size: int) -> None:
    torch.manual_seed(0)
    model = create_model(arch, NUM_CLASSES, size).train()
    batch = 2 if size == 224 else 3
    x = torch.randn(batch, 3, size, size)
    logits = model(x)
    assert logits.shape == (batch, NUM_CLASSES)
    logits.logsumexp(dim=1).sum().backward()
    grad = _convs(model)[0].weight.grad
    assert grad is not None
    assert torch.isfinite(grad).all()
    assert grad.abs().sum() > 0


def test_conv11_structure() -> None:
    convs = _convs(create_model("conv11", NUM_CLASSES, 32))
    assert len(convs) == 11
    assert all(c.kernel_size == (3, 3) and c.bias is None for c in convs)


@pytest.mark.parametrize("arch,n_convs", [("vgg11", 8), ("vgg16", 13)])
def test_vgg_structure(arch: str, n_convs: int) -> None:
    model = create_model(arch, NUM_CLASSES, 224)
    assert len(_convs(model)) == n_convs
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(512, NUM_CLASSES)]


def test_resnet50_small_stem() -> None:
    model = create_model("resnet50", NUM_CLASSES, 32)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert model.conv1.out_channels == 64
    assert isinstance(model.maxpool, nn.Identity)


def test_resnet50_standard_stem() -> None:
    model = create_model("resnet50", NUM_CLASSES, 224)
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert isinstance(model.maxpool, nn.MaxPool2d)


def test_resnet50_zero_init_residual() -> None:
    model = create_model("resnet50", NUM_CLASSES, 32)
    for block in (*model.layer1, *model.layer2, *model.layer3, *model.layer4):
        assert torch.all(block.bn3.weight == 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_inputs(arch: str) -> None:
    # Below 32 px no pooling may shrink a map to zero.
    model = create_model(arch, NUM_CLASSES, 16).eval()
    with torch.no_grad():
        for size in (1, 7, 16):
            assert model(torch.randn(2, 3, size, size)).shape == (2, NUM_CLASSES)


def test_unknown_arch() -> None:
    with pytest.raises(ValueError, match="no_such_net") as info:
        create_model("no_such_net", NUM_CLASSES)
    for name in ARCHS:
        assert name in str(info.value)


def test_duplicate_registration() -> None:
    with pytest.raises(ValueError, match="conv11"):
        register_model("conv11")(lambda num_classes, image_size: nn.Identity())


@pytest.mark.parametrize("arch", ARCHS)
def test_channels_last_matches(arch: str) -> None:
    torch.manual_seed(0)
    model = create_model(arch, NUM_CLASSES, 32).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        model = model.to(memory_format=torch.channels_last)
        out = model(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_conv11_overfits_tiny_set() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 3, 32, 32)
    y = torch.arange(64) % 4
    model = create_model("conv11", 4, 32, width=16)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    acc = 0.0
    for step in range(1, 61):
        model.train()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step % 10 == 0:
            # Eval mode: the BN running statistics must have caught up too.
            model.eval()
            with torch.no_grad():
                acc = (model(x).argmax(1) == y).float().mean().item()
            if acc == 1.0:
                break
    assert acc == 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_without_graph_breaks(arch: str) -> None:
    # The "eager" backend checks that Dynamo traces the whole forward (no Python-side shape
    # logic) without paying for Inductor's code generation.
    torch._dynamo.reset()
    model = create_model(arch, NUM_CLASSES, 32)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(3, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    assert compiled(x).shape == (3, NUM_CLASSES)
