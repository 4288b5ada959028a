"""Catalog GPU names -> nvidia.com/gpu.product labels, and the --gpu-product override."""

from __future__ import annotations

import pytest

from helixserve.deploy.gpu_labels import (
    CPU_GPU,
    DEFAULT_GPU_PRODUCTS,
    check_label_value,
    gpu_product_label,
    parse_gpu_product_overrides,
)
from helixserve.errors import UserError
from helixserve.spec import load_gpu_catalog


def test_every_catalog_gpu_has_a_valid_default_label() -> None:
    catalog = load_gpu_catalog()
    gpus = [name for name in catalog.names() if name != CPU_GPU]
    assert gpus, "empty catalog"
    missing = [name for name in gpus if name not in DEFAULT_GPU_PRODUCTS]
    assert missing == [], f"add a nvidia.com/gpu.product default for {missing}"
    for label in DEFAULT_GPU_PRODUCTS.values():
        assert check_label_value(label, "test") == label


def test_known_labels_and_overrides() -> None:
    assert gpu_product_label("A100-40GB") == "NVIDIA-A100-SXM4-40GB"
    assert gpu_product_label("L4") == "NVIDIA-L4"
    assert gpu_product_label("T4") == "Tesla-T4"
    overrides = parse_gpu_product_overrides(["A100-40GB=NVIDIA-A100-PCIE-40GB", "MI300X=AMD-X"])
    assert gpu_product_label("A100-40GB", overrides) == "NVIDIA-A100-PCIE-40GB"
    assert gpu_product_label("T4", overrides) == "Tesla-T4"
    assert gpu_product_label("MI300X", overrides) == "AMD-X"


def test_unknown_gpu_names_the_flag_to_pass() -> None:
    with pytest.raises(UserError, match=r"GPU 'B200'; known: A10, A100-40GB.*--gpu-product B200="):
        gpu_product_label("B200")


@pytest.mark.parametrize("item", ["T4", "=Tesla-T4", "T4=", "T4=Tesla T4", "T4=-bad"])
def test_malformed_overrides(item: str) -> None:
    with pytest.raises(UserError, match="--gpu-product"):
        parse_gpu_product_overrides([item])
