"""A regression task, complete and minimal: copy this folder over a baked project's
src/<package>/task/ to start a task of your own (docs/tasks.md walks through the steps)."""
