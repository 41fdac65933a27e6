"""Yours: what this project trains, a language model. task.py is what the engine calls (engine/seam.py
declares it), config.py what it reads; the rest, prepare and generate among them, are the task's own."""
