"""Test-wide set-up: make tests/ importable (shared reference builders live there) for the test
process and, through sys.path, for the ranks it spawns."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
