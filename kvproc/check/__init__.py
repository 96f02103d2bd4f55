"""`kvproc check`: prove a model's KV contract before it serves (issue 40). `check_model(model)` is the API,
`kvproc.check.cli` the command."""

from kvproc.check.api import check_model
from kvproc.check.report import CheckReport, Failure, GroupRow

__all__ = ["CheckReport", "Failure", "GroupRow", "check_model"]
