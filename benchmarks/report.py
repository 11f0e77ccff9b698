"""What a benchmark section hands back: Markdown text plus target verdicts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Target:
    """One target of issue 3: the measured figure, the goal, and whether it is met."""

    name: str
    measured: str
    goal: str
    met: bool | None  # None: informational, no pass/fail


@dataclass
class Section:
    title: str
    body: str
    targets: list[Target] = field(default_factory=list)

    def markdown(self) -> str:
        return f"### {self.title}\n\n{self.body}\n"


def verdict(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "—"}[met]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"
