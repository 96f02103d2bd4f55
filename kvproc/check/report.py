"""What `kvproc check` finds: a row per group (cached, or why not), the checks that ran, and every failure with the
group, the arena and the byte offset where the bytes first differ."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Failure:
    check: str  # which proof failed ("host round trip", "stored layout", ...)
    group: str
    detail: str
    arena: str = ""
    offset: int | None = None  # byte offset in the arena's tensor where the bytes first differ

    def line(self) -> str:
        where = f"group {self.group!r}" + (f", arena {self.arena!r}" if self.arena else "")
        at = f", byte offset {self.offset}" if self.offset is not None else ""
        return f"FAIL {self.check}: {where}{at}: {self.detail}"


@dataclass(frozen=True)
class GroupRow:
    group: str
    kind: str
    sharding: str
    cached: bool
    why: str  # why it is not cached ("" when it is)


@dataclass
class CheckReport:
    model: str
    ranks: int
    rows: list[GroupRow] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)  # one line per proof that held
    notes: list[str] = field(default_factory=list)  # what was not checked, and why; advice that is not a failure
    failures: list[Failure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def text(self) -> str:
        head = ("group", "kind", "sharding", "cached", "why not")
        cells = [head] + [(r.group, r.kind, r.sharding, "yes" if r.cached else "no", r.why or "-") for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(4)]
        lines = [f"kvproc check: {self.model} ({self.ranks} rank{'s' if self.ranks != 1 else ''})", ""]
        for c in cells:
            lines.append("  ".join(c[i].ljust(widths[i]) for i in range(4)) + "  " + c[4])
        lines.append("")
        lines += [f"ok   {p}" for p in self.passed]
        lines += [f"note {n}" for n in self.notes]
        lines += [f.line() for f in self.failures]
        lines.append("")
        lines.append("PASS" if self.ok else f"FAILED: {len(self.failures)} check(s)")
        return "\n".join(lines)
