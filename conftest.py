"""Put the checkout on sys.path so tests (and the ranks they spawn) import this `longstraw_mcore`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
