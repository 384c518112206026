"""Thin Ray actors: each holds a plain object (usable without Ray) and forwards to it."""
