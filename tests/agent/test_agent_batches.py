"""Log frames carry batches of lines: few frames for many lines, exact offsets, pieces of long lines."""
from __future__ import annotations

from hgcli.node.agent.logs import CHUNK, frame_lines, log_frames, split_batches

from .harness import log_lines, py, wait_until

MANY = "import sys\nfor i in range(100000):\n    sys.stdout.write(f'line {i}\\n')\n"


def tile(frames: list[dict]) -> bool:
    return all(b["offset"] == a["end"] for a, b in zip(frames, frames[1:]))


def test_a_batch_is_every_whole_line_with_its_exact_file_range():
    buf = bytearray(b"one\ntwo\nthr")
    assert list(split_batches(buf, 100, final=False)) == [(b"one\ntwo\n", 108, False)]
    assert buf == b"thr"
    buf += b"ee\nfo"
    assert list(split_batches(buf, 108, final=False)) == [(b"three\n", 114, False)]
    assert list(split_batches(buf, 114, final=True)) == [(b"fo", 116, False)]
    assert buf == b""
    # a stream that may go on (a non-follow tail of a running job): the unterminated end is partial
    assert list(split_batches(bytearray(b"a\nb"), 0, final=True, open_end=True)) == [(b"a\nb", 3, True)]
    assert list(split_batches(bytearray(b"a\n"), 0, final=True, open_end=True)) == [(b"a\n", 2, False)]


def test_a_long_line_ends_its_batch_in_pieces_that_keep_characters_whole():
    long = ("\u20ac" * CHUNK).encode()          # 3-byte characters: CHUNK is not a multiple of 3
    data = b"before\n" + long + b"\nafter\n"
    buf = bytearray(data)
    batches = list(split_batches(buf, 0, final=False))
    assert batches[0][0].startswith(b"before\n") and all(b[2] for b in batches[:-1])
    assert not batches[-1][2] and batches[-1][0].endswith(b"\nafter\n")
    pieces = [b[0].rsplit(b"\n", 1)[-1] for b in batches[:-1]]
    assert len(pieces) == 3 and all(len(p) <= CHUNK for p in pieces)
    rest = batches[-1][0].split(b"\n", 1)[0]
    # each piece decodes alone, and the pieces with the rest are the line
    assert "".join(p.decode("utf-8") for p in pieces) + rest.decode("utf-8") == "\u20ac" * CHUNK
    assert b"".join(b[0] for b in batches) == data and batches[-1][1] == len(data)
    # a line of exactly CHUNK bytes is not cut
    exact = b"x" * CHUNK + b"\n"
    assert list(split_batches(bytearray(exact), 0, final=False)) == [(exact, len(exact), False)]


def test_frames_escape_bad_bytes_and_give_lines_back():
    make = log_frames(3, "err")
    (frame,) = make(bytearray(b"bad \xff byte\ncaf\xc3\xa9\n"), 10, False, False)
    assert frame == {"type": "logs", "rank": 3, "stream": "err", "offset": 10, "end": 27,
                     "text": "bad \\xff byte\ncaf\u00e9\n"}
    assert frame_lines(frame) == (["bad \\xff byte", "caf\u00e9"], False)
    (piece,) = make(bytearray(b"x" * (CHUNK + 5)), 0, False, False)
    assert piece["partial"] is True and frame_lines(piece) == (["x" * CHUNK], True)


def test_many_lines_arrive_in_few_frames_that_tile_the_file(start_agent):
    agent = start_agent([{"rank": 0, "argv": py(MANY)}])
    end = agent.wait_type("end")
    assert end["state"] == "succeeded" and end["logs_complete"] is True
    out = [f for f in agent.of_type("logs") if f["stream"] == "out"]
    assert agent.lines(0) == [f"line {i}" for i in range(100000)]
    size = (agent.job_dir / "rank-0.out").stat().st_size
    assert out[0]["offset"] == 0 and out[-1]["end"] == size and tile(out)
    assert len(out) <= 200          # ~1.2 MB: a handful of reads, never a frame per line


def test_tail_resumes_exactly_from_inside_a_batch(start_agent):
    agent = start_agent([{"rank": 0, "argv": py(MANY)}], detach=True)
    agent.wait_type("detached")
    agent.wait_exit()
    path = agent.job_dir / "rank-0.out"
    expected = [f"line {i}" for i in range(100000)]

    def finished():
        rc, found = agent.control("--tail", agent.job_id)
        return found if found[-1].get("complete") else None

    whole = wait_until(finished, what="the detached job to end")
    frames = [f for f in whole if f.get("type") == "logs" and f["stream"] == "out"]
    assert log_lines(frames, 0) == expected and tile(frames) and frames[-1]["end"] == path.stat().st_size
    # the offset of line 54321: inside a batch, not at a frame boundary
    data = path.read_bytes()
    at = data.index(b"line 54321\n")
    assert at not in {f["end"] for f in frames}
    rc, more = agent.control("--tail", agent.job_id, "--from", f"0:out={at},0:err=0")
    assert rc == 0 and more[-1]["type"] == "tail_end" and more[-1]["complete"] is True
    assert log_lines(more, 0) == expected[54321:]
    assert f"0:out={len(data)}" in more[-1]["offsets"]


def test_an_unterminated_last_line_of_a_running_job_is_marked_partial(start_agent):
    code = ("import sys, time\nsys.stdout.write('done\\nhalf a li'); sys.stdout.flush()\n"
            "time.sleep(300)\n")
    agent = start_agent([{"rank": 0, "argv": py(code)}], detach=True)
    agent.wait_type("detached")
    agent.wait_exit()

    def tail():
        rc, found = agent.control("--tail", agent.job_id)
        out = [f for f in found if f.get("type") == "logs" and f["stream"] == "out"]
        return out if out and out[-1]["end"] == 14 else None

    out = wait_until(tail, what="both lines in the node-local file")
    assert "".join(f["text"] for f in out) == "done\nhalf a li" and out[-1]["partial"] is True
    assert log_lines(out, 0) == ["done"]      # the unfinished line is not a line yet
    rc, (res,) = agent.control("--stop", agent.job_id)
    assert res["left"] == []
