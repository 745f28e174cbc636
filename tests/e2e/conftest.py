"""Keep each phase's report on the test item (``item.rep_call``), so a fixture can print
diagnostics after a failed test (the pattern of pytest's docs, "Making test result information
available in fixtures")."""

from __future__ import annotations

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
