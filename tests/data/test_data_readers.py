"""File readers: tiny files written here in the exact standard formats, read back.

MNIST idx: big-endian magic ``00 00 08 ndim``, then ``ndim`` big-endian uint32 sizes,
then the bytes. CIFAR-10 binary: records of 1 label byte + 3072 pixel bytes (R, G, B
planes of 32x32). CIFAR-100 binary: coarse label byte + fine label byte + 3072 pixels.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch

from aiopipe.data import Dataset, FileDataset, open_dataset
from aiopipe.errors import ConfigError

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


def idx_bytes(array: npt.NDArray[np.uint8]) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def write_mnist(
    folder: Path, rng: np.random.Generator, *, train: int = 30, test: int = 12, gz: bool = False
) -> dict[str, tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]:
    folder.mkdir(parents=True, exist_ok=True)
    data = {}
    for prefix, count in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, count, dtype=np.uint8)
        for kind, array in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
            path = folder / f"{prefix}-{kind}"
            if gz:
                path.with_name(path.name + ".gz").write_bytes(gzip.compress(idx_bytes(array)))
            else:
                path.write_bytes(idx_bytes(array))
        data[prefix] = (images, labels)
    return data


def write_cifar(
    folder: Path, rng: np.random.Generator, files: dict[str, int], *, label_bytes: int
) -> dict[str, tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]:
    folder.mkdir(parents=True, exist_ok=True)
    data = {}
    for file, count in files.items():
        images = rng.integers(0, 256, (count, 3, 32, 32), dtype=np.uint8)
        classes = 10 if label_bytes == 1 else 100
        labels = rng.integers(0, classes, count, dtype=np.uint8)
        head = labels[:, None] if label_bytes == 1 else np.stack([labels // 5, labels], axis=1)
        records = np.concatenate([head, images.reshape(count, -1)], axis=1)
        (folder / file).write_bytes(records.tobytes())
        data[file] = (images, labels)
    return data


def pixels(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Undo the normalization, back to uint8 pixel values."""
    shape = (1, len(mean), 1, 1)
    raw = x * torch.tensor(std).view(shape) + torch.tensor(mean).view(shape)
    return (raw * 255.0).round().to(torch.uint8)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_round_trip(tmp_path: Path, gz: bool) -> None:
    data = write_mnist(tmp_path, np.random.default_rng(0), train=30, test=12, gz=gz)
    name = f"mnist:{tmp_path}"
    train = open_dataset(name)
    val = open_dataset(name, split="val")
    test = open_dataset(name, split="test")
    assert isinstance(train, Dataset)
    assert isinstance(train, FileDataset)
    assert (train.name, train.num_classes, train.in_shape) == (name, 10, (1, 28, 28))
    assert (len(train), len(val), len(test)) == (27, 3, 12)  # val: last 10% of train files
    images, labels = data["train"]
    x, y = train.batch(np.arange(27))
    assert x.dtype == torch.float32
    assert x.shape == (27, 1, 28, 28)
    assert torch.equal(pixels(x, (MNIST_MEAN,), (MNIST_STD,))[:, 0], torch.from_numpy(images[:27]))
    assert y.dtype == torch.int64
    assert y.tolist() == labels[:27].tolist()
    assert train.labels().tolist() == labels[:27].tolist()
    xv, yv = val.batch([2, 0])
    assert torch.equal(
        pixels(xv, (MNIST_MEAN,), (MNIST_STD,))[:, 0], torch.from_numpy(images[[29, 27]])
    )
    assert yv.tolist() == labels[[29, 27]].tolist()
    test_images, test_labels = data["t10k"]
    xt, yt = test.batch(range(12))
    assert torch.equal(pixels(xt, (MNIST_MEAN,), (MNIST_STD,))[:, 0], torch.from_numpy(test_images))
    assert yt.tolist() == test_labels.tolist()


def test_mnist_normalization_uses_the_published_constants(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(1))
    x, _ = open_dataset(f"mnist:{tmp_path}").batch([0])
    raw = np.frombuffer(
        (tmp_path / "train-images-idx3-ubyte").read_bytes()[16 : 16 + 784], np.uint8
    )
    expected = (torch.from_numpy(raw.astype(np.float32)) / 255.0 - MNIST_MEAN) / MNIST_STD
    assert torch.allclose(x.flatten(), expected, atol=1e-5)


def test_size_caps_each_split(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(2), train=40, test=12)
    name = f"mnist:{tmp_path}"
    assert len(open_dataset(name, size=5)) == 5
    assert len(open_dataset(name, split="val", size=2)) == 2
    assert len(open_dataset(name, split="val", size=100)) == 4
    capped = open_dataset(name, split="val", size=2).labels()
    assert capped.tolist() == open_dataset(name, split="val").labels()[:2].tolist()


@pytest.mark.parametrize("nested", [False, True])
def test_cifar10_round_trip(tmp_path: Path, nested: bool) -> None:
    folder = tmp_path / "cifar-10-batches-bin" if nested else tmp_path
    files = {f"data_batch_{i}.bin": 4 + i for i in range(1, 6)} | {"test_batch.bin": 7}
    data = write_cifar(folder, np.random.default_rng(3), files, label_bytes=1)
    name = f"cifar10:{tmp_path}"
    train, val, test = (open_dataset(name, split=s) for s in ("train", "val", "test"))
    assert (train.num_classes, train.in_shape) == (10, (3, 32, 32))
    total = sum(4 + i for i in range(1, 6))  # 35 train samples across 5 files
    assert (len(train), len(val), len(test)) == (total - 3, 3, 7)
    all_images = np.concatenate([data[f"data_batch_{i}.bin"][0] for i in range(1, 6)])
    all_labels = np.concatenate([data[f"data_batch_{i}.bin"][1] for i in range(1, 6)])
    order = np.array([31, 0, 5, 6, 18, 4])  # crosses every file boundary, out of order
    x, y = train.batch(order)
    assert torch.equal(pixels(x, CIFAR10_MEAN, CIFAR10_STD), torch.from_numpy(all_images[order]))
    assert y.tolist() == all_labels[order].tolist()
    assert np.array_equal(train.labels(), all_labels[: total - 3])
    assert np.array_equal(val.labels(), all_labels[total - 3 :])
    xt, yt = test.batch(np.arange(7))
    images, labels = data["test_batch.bin"]
    assert torch.equal(pixels(xt, CIFAR10_MEAN, CIFAR10_STD), torch.from_numpy(images))
    assert yt.tolist() == labels.tolist()


@pytest.mark.parametrize("nested", [False, True])
def test_cifar100_round_trip_uses_fine_labels(tmp_path: Path, nested: bool) -> None:
    folder = tmp_path / "cifar-100-binary" if nested else tmp_path
    data = write_cifar(
        folder, np.random.default_rng(4), {"train.bin": 20, "test.bin": 6}, label_bytes=2
    )
    name = f"cifar100:{tmp_path}"
    train, test = open_dataset(name), open_dataset(name, split="test")
    assert (train.num_classes, train.in_shape, len(train), len(test)) == (100, (3, 32, 32), 18, 6)
    images, labels = data["train.bin"]
    x, y = train.batch([17, 3])
    assert torch.equal(pixels(x, CIFAR100_MEAN, CIFAR100_STD), torch.from_numpy(images[[17, 3]]))
    assert y.tolist() == labels[[17, 3]].tolist()
    assert (labels >= 20).any()  # the fine label, not the coarse one, comes back
    xt, yt = test.batch([5])
    assert torch.equal(
        pixels(xt, CIFAR100_MEAN, CIFAR100_STD)[0], torch.from_numpy(data["test.bin"][0][5])
    )
    assert int(yt[0]) == int(data["test.bin"][1][5])


@pytest.mark.parametrize(
    ("kind", "delete", "expected"),
    [
        ("mnist", "t10k-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"),
        ("cifar10", "test_batch.bin", "test_batch.bin"),
        ("cifar100", "test.bin", "test.bin"),
    ],
)
def test_missing_file_names_the_file_and_directory(
    tmp_path: Path, kind: str, delete: str, expected: str
) -> None:
    rng = np.random.default_rng(5)
    if kind == "mnist":
        write_mnist(tmp_path, rng)
    elif kind == "cifar10":
        write_cifar(tmp_path, rng, {"data_batch_1.bin": 2, "test_batch.bin": 2}, label_bytes=1)
    else:
        write_cifar(tmp_path, rng, {"train.bin": 2, "test.bin": 2}, label_bytes=2)
    (tmp_path / delete).unlink()
    with pytest.raises(ConfigError) as info:
        open_dataset(f"{kind}:{tmp_path}", split="test")
    assert expected in str(info.value)
    assert str(tmp_path) in str(info.value)


def test_missing_cifar10_batch_lists_the_expected_files(tmp_path: Path) -> None:
    write_cifar(tmp_path, np.random.default_rng(6), {"data_batch_1.bin": 2}, label_bytes=1)
    with pytest.raises(ConfigError, match=r"missing data_batch_2\.bin") as info:
        open_dataset(f"cifar10:{tmp_path}")
    assert "data_batch_5.bin" in str(info.value)
    assert "test_batch.bin" in str(info.value)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        open_dataset(f"mnist:{tmp_path / 'nowhere'}")


def truncate(path: Path, drop: int) -> None:
    path.write_bytes(path.read_bytes()[:-drop])


def test_truncated_idx_file(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(7))
    truncate(tmp_path / "train-images-idx3-ubyte", 100)
    with pytest.raises(ConfigError, match=r"train-images-idx3-ubyte: truncated"):
        open_dataset(f"mnist:{tmp_path}")


def test_truncated_gz_file(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(8), gz=True)
    truncate(tmp_path / "t10k-images-idx3-ubyte.gz", 30)
    with pytest.raises(ConfigError, match=r"t10k-images-idx3-ubyte\.gz"):
        open_dataset(f"mnist:{tmp_path}", split="test")


def test_not_gzip_at_all(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(8))
    (tmp_path / "train-labels-idx1-ubyte").rename(tmp_path / "train-labels-idx1-ubyte.gz")
    with pytest.raises(ConfigError, match=r"train-labels-idx1-ubyte\.gz"):
        open_dataset(f"mnist:{tmp_path}")


def test_bad_idx_magic(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(9))
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(b"\x00\x00\x0d\x01" + path.read_bytes()[4:])  # float32 data
    with pytest.raises(
        ConfigError, match=r"train-labels-idx1-ubyte: bad idx magic number 00000d01"
    ):
        open_dataset(f"mnist:{tmp_path}")


def test_idx_header_shorter_than_its_dimensions(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(10))
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03\x00")
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte: truncated idx file"):
        open_dataset(f"mnist:{tmp_path}")


def test_image_label_count_mismatch(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(11), train=30)
    labels = np.zeros(29, dtype=np.uint8)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(labels))
    with pytest.raises(ConfigError, match="30 images but train-labels-idx1-ubyte holds 29 labels"):
        open_dataset(f"mnist:{tmp_path}")


def test_label_out_of_range(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(12), test=4)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.array([1, 2, 10, 3], np.uint8)))
    with pytest.raises(ConfigError, match="t10k-labels-idx1-ubyte: record 2 has label 10"):
        open_dataset(f"mnist:{tmp_path}", split="test")


@pytest.mark.parametrize(
    ("kind", "file", "drop"), [("cifar10", "test_batch.bin", 1), ("cifar100", "test.bin", 3000)]
)
def test_truncated_cifar_record(tmp_path: Path, kind: str, file: str, drop: int) -> None:
    files = {"test_batch.bin": 3} if kind == "cifar10" else {"test.bin": 3}
    write_cifar(
        tmp_path, np.random.default_rng(13), files, label_bytes=1 if kind == "cifar10" else 2
    )
    truncate(tmp_path / file, drop)
    with pytest.raises(ConfigError, match=rf"{file}: truncated or malformed"):
        open_dataset(f"{kind}:{tmp_path}", split="test")


def test_empty_cifar_file(tmp_path: Path) -> None:
    (tmp_path / "test_batch.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"test_batch\.bin: truncated or malformed: 0 bytes"):
        open_dataset(f"cifar10:{tmp_path}", split="test")


def test_cifar10_label_out_of_range(tmp_path: Path) -> None:
    write_cifar(tmp_path, np.random.default_rng(14), {"test_batch.bin": 2}, label_bytes=1)
    path = tmp_path / "test_batch.bin"
    raw = bytearray(path.read_bytes())
    raw[3073] = 12  # the second record's label byte
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"test_batch\.bin: record 1 has label 12"):
        open_dataset(f"cifar10:{tmp_path}", split="test")


def test_reader_batch_rejects_bad_indices(tmp_path: Path) -> None:
    write_mnist(tmp_path, np.random.default_rng(15))
    ds = open_dataset(f"mnist:{tmp_path}", split="test")
    with pytest.raises(ConfigError, match="out of range"):
        ds.batch([len(ds)])
