"""Interpreter, OS and torch-internal speed tricks, in one place behind one switch."""
