"""The tutorial's GradScaler examples (test03, test04), with amped.

The tutorial runs them on CUDA; this runs on CUDA when it is there and on the CPU
otherwise. The printed values are the tutorial's: without a scaler the gradient of
``param**2 + 3`` at 2.0 is 4 and SGD (lr 0.1) moves the parameter to 1.6; with one,
the gradient is scaled by 65536 to 262144, unscaled before the step, and the
parameter still lands on 1.6.

    python examples/tutorial_gradscaler.py    # needs only torch and amped

It prints the tutorial's own labels, in Chinese, so its output can be compared line by line:
缩放因子 is "scale factor" and 梯度值 "gradient value". The lines without a label are,
in order: the loss, the gradient, the parameter after the step; and at the end, the
scale for the next step.
"""

import torch
from torch import optim

import amped


def test03(device: str) -> None:
    # The parameter and its optimizer
    param = torch.tensor(2.0, requires_grad=True, device=device)
    optimizer = optim.SGD([param], lr=0.1, momentum=0)

    # Forward, backward, step
    result = param**2 + 3
    print(result)
    result.backward()
    print(param.grad)
    optimizer.step()
    print(param)


def test04(device: str) -> None:
    scaler = amped.GradScaler(device)

    param = torch.tensor(2.0, requires_grad=True, device=device)
    optimizer = optim.SGD([param], lr=0.1, momentum=0)

    result = param**2 + 3
    print(result)
    # Backward from the scaled loss: the gradient is multiplied by the scale
    scaler.scale(result).backward()
    print("缩放因子:", scaler.get_scale(), "梯度值:", param.grad)

    # step() unscales the gradient, and skips optimizer.step() if it holds inf or NaN
    scaler.step(optimizer)
    print(param)

    # Update the scale for the next iteration (the tutorial's output ends with it)
    scaler.update()
    print(scaler.get_scale())


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    test03(device)
    print("-" * 50)
    test04(device)
