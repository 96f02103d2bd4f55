"""What the tier tests share: page keys and a clock the test moves by hand."""

K = [bytes([i]) * 16 for i in range(32)]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t
