"""The tutorial's autocast examples (test01, test02), with amped.

The tutorial runs test02 on CUDA; this runs on CUDA when it is there and on the CPU
otherwise (where autocast's default low dtype is bfloat16 rather than float16).

    python examples/tutorial_autocast.py      # needs only torch and amped

It prints the tutorial's own labels, in Chinese, so its output can be compared line by line:
默认张量类型 is "the default dtype", 新创建张量类型 "the dtype of a newly created
tensor". Then a float32 matmul under autocast comes out in the low dtype (mm is on
autocast's lower-precision list) while an add stays float32 (add is on no list).
"""

import torch

import amped


def test01() -> None:
    # Default tensor type, and changing it.
    print("默认张量类型:", torch.get_default_dtype())
    print("新创建张量类型:", torch.tensor(3.14).dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    print("新创建张量类型:", torch.tensor(3.14).dtype)
    torch.set_default_dtype(previous)


def test02(device: str) -> None:
    a = torch.rand((8, 8), device=device)
    b = torch.rand((8, 8), device=device)
    print(a.dtype, b.dtype)

    # Without autocast
    c = torch.mm(a, b)
    print("torch.mm(a, b):", c.dtype)

    # With autocast
    with amped.autocast(device_type=device):
        # mm changes type
        c = torch.mm(a, b)
        print("autocast torch.mm(a, b):", c.dtype)

        # add does not
        d = torch.add(a, b)
        print("autocast torch.add(a, b):", d.dtype)


if __name__ == "__main__":
    test01()
    print("-" * 50)
    test02("cuda" if torch.cuda.is_available() else "cpu")
