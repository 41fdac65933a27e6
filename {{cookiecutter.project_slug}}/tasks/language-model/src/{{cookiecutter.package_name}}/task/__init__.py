"""Yours: what this project trains, a language model. task.py is what the engine calls (engine/seam.py
declares it), config.py what it reads; the rest, prepare and generate among them, are the task's own.

    task                the Task: data sets, model, loss, validation, export; what the engine calls
    config              the data and model sections and the task's SPEC
    tokenizer           bytes, the synthetic alphabet, a local tokenizer.json
    data                the synthetic Markov source, token files, training windows and packed conversations
    chat                conversations: records to messages, chat templates, which tokens are trained
    validation          exact validation metrics over the whole split, any number of processes
    model/              the transformer: its shape and presets, the gpt2 and llama families, Hugging Face folders
    prepare/            text files to token files (python -m PACKAGE.prepare)
    generate            text from a checkpoint (python -m PACKAGE.generate)
"""
