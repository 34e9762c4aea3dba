"""JUnit XML for CI dashboards: one test case per audited probe."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from ..storage import atomic_write

# Characters XML 1.0 cannot hold at all (escaping does not help): C0 controls but tab/LF/CR.
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


@dataclass
class JUnitCase:
    """One test case: a probe's verdict, and the report text shown with it."""

    name: str
    classname: str
    time: float  # seconds
    failure_message: str | None = None  # None: the case passed
    details: str = ""
    error: str | None = None  # not passed and no divergence: why (a crash, an interruption)


def junit_case(
    name: str, classname: str, seconds: float, passed: bool, headline: str, details: str,
    error: str | None = None,
) -> JUnitCase:
    """The one way a verdict becomes a test case: failed (with the headline) unless it passed;
    an `error` (the verdict of a run that crashed, was interrupted or compared nothing) is
    an error of that type, never a divergence."""
    return JUnitCase(name, classname, seconds, None if passed else headline, details,
                     None if passed else error)


def junit_xml(cases: list[JUnitCase], suite: str = "detaudit") -> str:
    """The cases as one JUnit XML document (testsuites > testsuite > testcase > failure)."""
    errors = sum(1 for c in cases if c.failure_message is not None and c.error)
    failures = sum(1 for c in cases if c.failure_message is not None) - errors
    total = f"{sum(c.time for c in cases):.3f}"
    counts = {"tests": str(len(cases)), "failures": str(failures), "errors": str(errors),
              "time": total}
    root = ET.Element("testsuites", {"name": suite, **counts})
    node = ET.SubElement(root, "testsuite", {"name": suite, "skipped": "0", **counts})
    for case in cases:
        attributes = {"name": case.name, "classname": case.classname, "time": f"{case.time:.3f}"}
        element = ET.SubElement(node, "testcase", {k: _clean(v) for k, v in attributes.items()})
        if case.failure_message is not None:
            failure = ET.SubElement(
                element, "error" if case.error else "failure",
                {"message": _clean(case.failure_message), "type": case.error or "divergence"},
            )
            failure.text = _clean(case.details)
        elif case.details:
            ET.SubElement(element, "system-out").text = _clean(case.details)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(path: str | Path, cases: list[JUnitCase], suite: str = "detaudit") -> Path:
    """Write :func:`junit_xml` of the cases to `path`; return the path."""
    return atomic_write(path, junit_xml(cases, suite))


def _clean(text: str) -> str:
    """Text without characters XML 1.0 cannot represent (ANSI escapes, NULs)."""
    return _INVALID_XML.sub("", text)
