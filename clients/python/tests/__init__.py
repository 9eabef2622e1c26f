"""Tests of the mep Python SDK. They import the package from this source tree (never an
installed copy) and run against real ``mep``/``mepd`` processes named by ``$MEP_BIN`` and
``$MEPD_BIN``; see harness.py."""
import os
import sys

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[:1] != [SOURCE_ROOT]:
    sys.path.insert(0, SOURCE_ROOT)
