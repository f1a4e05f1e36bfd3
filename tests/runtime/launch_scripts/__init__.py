"""Tiny training scripts the launcher tests start as real processes."""
