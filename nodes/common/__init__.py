"""Small things every capability uses, written once: report tables (report.py)."""
