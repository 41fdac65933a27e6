"""Yours: what this project trains, images and their classifier. task.py is what the engine calls
(engine/seam.py declares it), config.py what it reads; the rest are the task's own building blocks."""
