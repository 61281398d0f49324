"""Helpers shared by test folders: import them from here, never from another folder's ``test_*.py``."""
