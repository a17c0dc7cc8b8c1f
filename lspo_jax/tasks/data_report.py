"""What loading did to a data source's rows, counted for the run's log (``DataReport``), and the error of a source
that cannot be used as a whole (``DataError``). Bad rows never crash a run: each is counted here, and listed up to
``MAX_LISTED``."""

from __future__ import annotations

import dataclasses

MAX_LISTED = 100  # rows named in ``DataReport.row_errors``; the count is always complete


class DataError(ValueError):
    """A data file that cannot be used as a whole (no usable row, an unknown format, unreadable): the commands
    print it alone."""


@dataclasses.dataclass
class DataReport:
    """What loading did to the rows, for the run's log.

    ``rows`` counts every record of the source; ``rows_invalid`` those skipped for a missing field, a field of a
    type no grader reads (a list answer, a dict problem) or a line that is not JSON, the first ``MAX_LISTED`` of
    them described in ``row_errors`` (with rows kept whose solution was not a string). Solutions are counted
    as they are tokenised (``solutions_encoded``): a file's at start, a cached source's when first used, so
    ``solution_skipped``, ``solution_truncated`` and ``solution_errors`` (a solution that failed to tokenise:
    never a scaffold target, listed in ``row_errors``) count those so far. ``prompt_longest`` is the longest prompt
    rendered (tokens), ``max_prompt_tokens`` the limit it was held to (0: a report not made by loading), and
    ``solution_column`` the column the worked solutions were read from.
    """

    rows: int = 0
    kept: int = 0
    rows_invalid: int = 0
    row_errors: list[str] = dataclasses.field(default_factory=list)
    prompt_skipped: int = 0
    prompt_truncated: int = 0
    solution_missing: int = 0
    solutions_encoded: int = 0
    solution_skipped: int = 0
    solution_truncated: int = 0
    solution_errors: int = 0
    gold_unparseable: list[str] = dataclasses.field(default_factory=list)
    prompt_longest: int = 0
    max_prompt_tokens: int = 0
    solution_column: str = ""

    def losses(self) -> str | None:
        """One line on the rows that loading dropped or cut, for the console; None when it kept them all whole."""
        lost = {k: getattr(self, k) for k in ("rows_invalid", "prompt_skipped", "prompt_truncated") if getattr(self, k)}
        if self.gold_unparseable:
            lost["gold_unparseable"] = len(self.gold_unparseable)
        if not lost:
            return None
        example = f"; e.g. {self.row_errors[0]}" if self.row_errors else ""
        length = f"; {line}" if (line := self.too_long()) else ""
        return f"{self.kept} of {self.rows} rows kept; {lost}{example}{length}"

    def too_long(self) -> str | None:
        """The prompts over ``data.max_prompt_tokens``, the longest, and the key that keeps them; None when none
        was (or the report names no limit)."""
        over = self.prompt_skipped + self.prompt_truncated
        if not over or not self.max_prompt_tokens:
            return None
        limit = self.max_prompt_tokens
        said = (f"{over} of {self.kept + self.prompt_skipped} prompts are longer than data.max_prompt_tokens={limit} "
                f"(the longest {self.prompt_longest} tokens, with the template and instruction)")  # fmt: skip
        if self.prompt_skipped:
            return f"{said}; raise data.max_prompt_tokens or set data.prompt_policy: truncate"
        return f"{said}, cut to their last {limit} tokens; raise data.max_prompt_tokens to keep them whole"

    def no_solution(self) -> str | None:
        """A line when no kept row has a worked solution: the scaffold has nothing to learn a cliff from."""
        if not self.kept or self.solution_missing < self.kept:
            return None
        column = f" (column {self.solution_column!r})" if self.solution_column else ""
        return (
            f"no row has a worked solution{column}: cliffs cannot be rescued, as the LSPO scaffold learns "
            "from worked solutions, so the run behaves as DAPO on them; name the column in data.fields.solution"
        )

    def warnings(self, scaffold: bool = True) -> list[str]:
        """The lines a run prints on its training source: what loading dropped or cut (``losses``), and for a run
        whose scaffold learns from worked solutions, a source that has none (``no_solution``)."""
        lines = [self.losses(), self.no_solution() if scaffold else None]
        return [line for line in lines if line]

    def check_kept(self, what: str) -> None:
        """``DataError`` saying why, when loading kept no row of ``what`` (``data.train FILE``): the prompts' length
        and the key that fixes it, else what was lost."""
        if not self.kept:
            raise DataError(f"{what}: {self.too_long() or self.losses() or 'it holds no rows'}")

    def invalid(self, where: str, problem: str) -> None:
        self.rows_invalid += 1
        self.note(where, problem)

    def note(self, where: str, problem: str) -> None:
        """List a problem of a row that is kept (a solution of the wrong type), up to ``MAX_LISTED``."""
        if len(self.row_errors) < MAX_LISTED:
            self.row_errors.append(f"{where}: {problem}")
