"""Shared test helpers."""
from pathlib import Path

FIXTURE_DIR = Path(__file__).parent / "fixtures"
