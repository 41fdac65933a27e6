"""Encoding: pieces to token ids (conversations to ids and a mask of the trained tokens), in this
process or in --workers processes, jobs of about JOB bytes at a time."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ...engine.errors import DataError
from ..chat import ChatTemplate
from ..tokenizer import ByteTokenizer, load_tokenizer
from .pieces import Piece
from .split import Plan

JOB = 4 << 20  # bytes of text per tokenizing job: a worker's share of the work at a time


# Encoding: the same in the main process and in --workers processes.

_TOKENIZER, _CHAT = None, None


def _load_worker(spec: str, train_on: str | None) -> None:
    global _TOKENIZER, _CHAT
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: N workers use N cores
    _TOKENIZER = load_tokenizer(spec)
    _CHAT = None if train_on is None else (ChatTemplate.of(_TOKENIZER), train_on)


def _encode_texts(texts: list[bytes], tokenizer) -> list[np.ndarray]:
    if isinstance(tokenizer, ByteTokenizer):
        return [np.frombuffer(raw, dtype=np.uint8) for raw in texts]
    return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch([raw.decode() for raw in texts])]


@dataclass
class Conversation:
    """A --chat piece encoded: its ids, which of them are trained targets, and its rendered text's bytes."""

    ids: np.ndarray
    trained: np.ndarray  # uint8, 1 where the token is a trained target
    size: int
    answers: list[tuple[int, int]]  # (tokens, bytes) where each trained span ends: where it may be cut

    def cut(self, max_tokens: int) -> Conversation | None:
        """The conversation up to the end of its last answer that ends within max_tokens (None: none does):
        its turns from the start, as the template renders them, the answer's end of turn included."""
        fits = [(tokens, size) for tokens, size in self.answers if tokens <= max_tokens]
        if not fits:
            return None
        tokens, size = fits[-1]
        return Conversation(self.ids[:tokens], self.trained[:tokens], size, self.answers[: len(fits)])


def _segments(template: ChatTemplate, conversation: dict, train_on: str) -> list:
    try:
        return template.segments(conversation["messages"], train_on, conversation.get("tools"))
    except DataError as err:
        raise DataError(f"{conversation['where']}: {err}") from None


def encode_conversations(pieces: list[Piece], dtype: str, tokenizer, chat: tuple[ChatTemplate, str]) -> list:
    """Each conversation rendered with the chat template, cut where training starts and stops, each piece
    tokenized on its own (tokenizer.encode_spans: no prefix space but at the text's start); refused when
    the ids do not spell the rendered text exactly."""
    template, train_on = chat
    records = [json.loads(piece.raw) for piece in pieces]
    spans = [_segments(template, record, train_on) for record in records]
    encoded = tokenizer.encode_spans([[segment.text for segment in segments] for segments in spans])
    spelled = tokenizer.spelled([[i for part in parts for i in part] for parts in encoded])
    out = []
    for record, segments, parts, back in zip(records, spans, encoded, spelled, strict=True):
        text = "".join(segment.text for segment in segments)
        if back != text:
            raise DataError(f"{record['where']}: {unspelled(tokenizer, text, back)}")
        ids = np.concatenate([np.asarray(part, dtype=np.int64) for part in parts]).astype(dtype)
        pairs = zip(parts, segments, strict=True)
        trained = np.concatenate([np.full(len(part), segment.trained, dtype=np.uint8) for part, segment in pairs])
        sizes = np.cumsum([len(segment.text.encode("utf-8")) for segment in segments])
        tokens = np.cumsum([len(part) for part in parts])
        answers = [(int(t), int(b)) for t, b, segment in zip(tokens, sizes, segments, strict=True) if segment.trained]
        out.append(Conversation(ids, trained, int(sizes[-1]), answers))
    return out


def unspelled(tokenizer, text: str, spelled: str) -> str:
    """Why a tokenizer cannot train on a rendered text: where its ids spell something else."""
    at = next((i for i, (a, b) in enumerate(zip(text, spelled, strict=False)) if a != b), min(len(text), len(spelled)))
    return (
        f"the tokenizer {getattr(tokenizer, 'path', tokenizer.name)} does not give the chat template's text back "
        "(a normalizer or pre-tokenizer that changes text, or characters it cannot encode): at character "
        f"{at} the template wrote {text[at : at + 20]!r}, its tokens spell {spelled[at : at + 20]!r}"
    )


def encode_pieces(pieces: list[Piece], dtype: str, tokenizer=None, chat=None) -> list:
    """The token ids of each piece, the end-of-document token after each that ends one; for --chat pieces
    (all of a job or none), a Conversation each."""
    tokenizer, chat = tokenizer or _TOKENIZER, chat or _CHAT
    if pieces and pieces[0].chat:
        return encode_conversations(pieces, dtype, tokenizer, chat)
    encoded = _encode_texts([piece.raw for piece in pieces], tokenizer)
    out = []
    for ids, piece in zip(encoded, pieces, strict=True):
        ends = piece.end and tokenizer.eot is not None
        array = np.empty(len(ids) + ends, dtype=dtype)
        array[: len(ids)] = ids
        if ends:
            array[-1] = tokenizer.eot
        out.append(array)
    return out


def jobs(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    """Pieces grouped into jobs of about JOB bytes, in order."""
    job, size = [], 0
    for piece in pieces:
        job.append(piece)
        size += len(piece.raw)
        if size >= JOB:
            yield job
            job, size = [], 0
    if job:
        yield job


def encoded(plan: Plan, tokenizer, dtype: str, workers: int, chat=None) -> Iterator[tuple[Piece, np.ndarray]]:
    """(piece, its ids) in the plan's order; with workers > 1 encoded by that many processes, a bounded
    number of jobs ahead, so memory does not grow with the corpus. The bytes tokenizer is a copy, faster
    in this process than the hand-over to another (--workers changes nothing for it)."""
    if workers == 1 or isinstance(tokenizer, ByteTokenizer):
        for job in jobs(plan.pieces()):
            yield from zip(job, encode_pieces(job, dtype, tokenizer, chat), strict=True)
        return
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_load_worker,
        initargs=(plan.options.tokenizer, plan.options.train_on if plan.options.chat else None),
    ) as pool:
        pending = collections.deque()
        for job in jobs(plan.pieces()):
            pending.append((job, pool.submit(encode_pieces, job, dtype)))
            if len(pending) > 2 * workers:
                done, future = pending.popleft()
                yield from zip(done, future.result(), strict=True)
        while pending:
            done, future = pending.popleft()
            yield from zip(done, future.result(), strict=True)
