"""Probing a video file with PyAV (the FFmpeg libraries shipped in its wheel).

Runs inside :mod:`longreel.pipelines.media.worker_main`, never in the pipeline process itself:
a hostile file can hang or crash the demuxer. The frame count is *counted* by demuxing
every packet of the video stream, because headers lie (or say nothing, as MPEG-PS and
Ogg do) and a truncated file keeps its header's claims.

Except where the container has an index whose claims can be checked cheaply: an MP4/MOV sample table gives
the frame count (``stream.frames``) and duration; the first packets (B-frame reordering) and the packets after
the last key frame are demuxed, and when they end where the table says (the tail's bytes are there: a
truncated file fails this) the table is trusted. Otherwise every packet is demuxed as above. On Big Buck
Bunny this reads ~50 packets instead of 14,315.

Matroska/WebM has no frame count, but a track that declares a constant frame rate and a muxer that wrote the
track's ``DURATION`` tag (ffmpeg and mkvmerge do, at the end of the file, beside the cues): the first packets
and, through the cues index, the packets from the last key frame on are demuxed; when every one of them lasts
one frame of the declared rate, they follow each other without a gap and the last one ends where the tag says,
the count is the span times the rate (a stream that declares a constant rate is trusted to keep it between the
two ends). A truncated file fails the tail check (its last packets are missing or short) and is demuxed packet
by packet; its segment duration (written at the start) still tells how long it should have been.
"""
from __future__ import annotations

from dataclasses import dataclass

PROBE_VERSION = "probe-v1"

# A file whose demuxed frames fall this far short of its header's claim is truncated.
TRUNCATION_RATIO = 0.9


class ProbeError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _rate(r) -> float | None:
    try:
        v = float(r) if r is not None else None
    except ZeroDivisionError:
        return None
    return v if v and v > 0 else None


def probe_file(path: str) -> dict:
    """Return the probe fields of a ``video`` record (everything but ids, uri, bytes, licence).

    Raises :class:`ProbeError` with a reject reason: ``not_a_video`` (unreadable container),
    ``no_video_stream`` (audio only), ``undecodable`` (no frame decodes), ``truncated``,
    ``zero_duration``.
    """
    import av  # imported here: the worker imports it once; the pipeline process never needs it

    try:
        return _probe(av, path)
    except av.error.FFmpegError as e:
        # a decoder or demuxer failing part way (a seek into zeroed bytes gave EPERM): the reject said
        # "PermissionError: Operation not permitted" of a file that was readable and damaged
        raise ProbeError("undecodable", f"the demuxer failed on it: {e}") from None


def _probe(av, path: str) -> dict:
    with _open(av, path) as container:
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams})
            raise ProbeError("no_video_stream", f"no video stream (streams: {kinds or 'none'})")
        vs = container.streams.video[0]
        cc = vs.codec_context
        audio = container.streams.audio
        header_frames = int(vs.frames or 0)
        scan = (_scan_indexed(av, container, vs, header_frames) or _scan_cues(av, container, vs)
                or _scan_packets(av, container, vs))
        duration = _duration(container, vs, scan, header_frames)
        fps_avg = _rate(vs.average_rate) or scan.n / duration
        fps_real = _rate(vs.base_rate) or _rate(vs.guessed_rate)
        rotation, width, height = _first_frame(av, container, vs)
        tb = vs.time_base
        return {
            "container": container.format.name,
            "duration_s": round(duration, 6),
            "fps_avg": round(fps_avg, 6),
            "fps_real": round(fps_real, 6) if fps_real else None,
            "n_frames": scan.n,
            "n_frames_header": header_frames or None,
            "width": int(width),
            "height": int(height),
            "rotation": rotation % 360,
            "video_codec": cc.name,
            "pix_fmt": cc.pix_fmt,
            "has_audio": bool(audio),
            "audio_codec": audio[0].codec_context.name if audio else None,
            # B-frame reordering makes the first decode timestamp negative; muxers shift every timestamp by it
            "decode_delay_s": (round(max(0.0, float(-scan.first_dts * tb)), 6)
                               if scan.first_dts is not None and tb else 0.0),
            "probe_version": PROBE_VERSION,
        }


def _open(av, path: str):
    try:
        return av.open(path, metadata_errors="ignore")
    except av.error.InvalidDataError as e:
        raise ProbeError("not_a_video", f"not a readable media container: {e}") from None
    except (av.error.FFmpegError, UnicodeDecodeError) as e:
        raise ProbeError("not_a_video", f"cannot open as media: {e}") from None


@dataclass
class _PacketScan:
    n: int = 0  # frames, counted by demuxing (no decoding)
    n_data: int = 0  # AVI stores repeated frames as empty packets: they count as frames, but not alone
    first_pts: int | None = None
    first_dts: int | None = None
    last_end: int | None = None  # the real end time, in the stream's time base
    error: str | None = None  # the demuxer's error, if it stopped early


def _scan_packets(av, container, vs) -> _PacketScan:
    """Every packet of the video stream, demuxed once: the frame count and the first and last times."""
    s = _PacketScan()
    try:
        for pkt in container.demux(vs):
            if pkt.dts is None and pkt.pts is None and pkt.size == 0:
                continue  # the demuxer's flush packet
            s.n += 1
            s.n_data += pkt.size > 0
            if s.first_dts is None and pkt.dts is not None:
                s.first_dts = pkt.dts
            if pkt.pts is not None:
                s.first_pts = pkt.pts if s.first_pts is None else min(s.first_pts, pkt.pts)
                end = pkt.pts + (pkt.duration or 0)
                s.last_end = end if s.last_end is None else max(s.last_end, end)
    except av.error.FFmpegError as e:
        s.error = str(e)
    if s.n_data == 0:
        raise ProbeError("undecodable", f"no video packets could be read{': ' + s.error if s.error else ''}")
    return s


INDEXED_FORMATS = ("mov", "mp4")  # demuxers whose sample table lists every packet (names in container.format.name)
HEAD_PACKETS = 32  # enough to see the smallest presentation time through B-frame reordering


def _scan_indexed(av, container, vs, header_frames: int) -> _PacketScan | None:
    """The :class:`_PacketScan` from an MP4/MOV sample table, checked against the packets at both ends; ``None``
    when the container has no such table or its end does not hold up (then every packet is demuxed)."""
    names = set(container.format.name.split(","))
    tb = vs.time_base
    if not names & set(INDEXED_FORMATS) or header_frames < 2 * HEAD_PACKETS or not vs.duration or tb is None:
        return None
    s = _PacketScan(n=header_frames, n_data=header_frames)
    try:
        for i, pkt in enumerate(container.demux(vs)):
            if i == HEAD_PACKETS:
                break
            if s.first_dts is None and pkt.dts is not None:
                s.first_dts = pkt.dts
            if pkt.pts is not None:
                s.first_pts = pkt.pts if s.first_pts is None else min(s.first_pts, pkt.pts)
        # the last key frame before the table's end, then every packet after it: their bytes must all be there
        container.seek((vs.start_time or 0) + vs.duration, stream=vs, backward=True, any_frame=False)
        for pkt in container.demux(vs):
            if pkt.pts is None:
                continue
            if pkt.size == 0 or pkt.is_corrupt:
                return None  # a hole (or a short read at the end of the file) where the table promised data
            end = pkt.pts + (pkt.duration or 0)
            s.last_end = end if s.last_end is None else max(s.last_end, end)
    except av.error.FFmpegError:
        return None
    finally:
        container.seek(0)
    start = vs.start_time or 0
    if s.first_pts is None or s.last_end is None or s.last_end - start != vs.duration:
        return None
    return s


MATROSKA = "matroska"


def _tag_seconds(text) -> float | None:
    """A Matroska ``DURATION`` tag (``HH:MM:SS.nnnnnnnnn``) in seconds, else None."""
    try:
        h, m, sec = str(text).split(":")
        v = int(h) * 3600 + int(m) * 60 + float(sec)
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None


def _scan_cues(av, container, vs) -> _PacketScan | None:
    """The :class:`_PacketScan` of a constant-rate Matroska/WebM track from its head, its tail (reached through
    the cues) and its ``DURATION`` tag; ``None`` when any of them does not hold up (then every packet is demuxed)."""
    if MATROSKA not in container.format.name.split(","):
        return None
    tb = vs.time_base
    fps = _rate(vs.average_rate)
    tag = _tag_seconds((vs.metadata or {}).get("DURATION"))
    if tb is None or not fps or tag is None or _rate(vs.base_rate) != fps or tag * fps < 2 * HEAD_PACKETS:
        return None
    frame_s, tick = 1.0 / fps, float(tb)

    def one_frame(pkt) -> bool:  # timestamps are rounded to the time base: a frame may read one tick short/long
        return pkt.duration is not None and abs(pkt.duration * tick - frame_s) <= tick

    s = _PacketScan()
    start = vs.start_time or 0
    try:
        for i, pkt in enumerate(container.demux(vs)):
            if i == HEAD_PACKETS:
                break
            if pkt.pts is None or pkt.size == 0 or not one_frame(pkt):
                return None
            if s.first_dts is None and pkt.dts is not None:
                s.first_dts = pkt.dts
            s.first_pts = pkt.pts if s.first_pts is None else min(s.first_pts, pkt.pts)
        container.seek(start + int(tag / tick), stream=vs, backward=True, any_frame=False)
        tail = []
        for pkt in container.demux(vs):
            if pkt.pts is None and pkt.size == 0:
                continue  # the demuxer's flush packet
            if pkt.pts is None or pkt.size == 0 or pkt.is_corrupt or not one_frame(pkt):
                return None
            tail.append(pkt.pts)
            end = pkt.pts + pkt.duration
            s.last_end = end if s.last_end is None else max(s.last_end, end)
    except av.error.FFmpegError:
        return None
    finally:
        container.seek(0)
    if s.first_pts is None or s.last_end is None or abs((s.last_end - start) * tick - tag) > 1.5 * tick:
        return None
    # every frame from the last key frame to the end is there: a lost packet (a B-frame shown before the last
    # one, say) leaves a gap in the presentation times
    tail.sort()
    steps = [(b - a) * tick for a, b in zip(tail, tail[1:])]
    if not tail or any(abs(d - frame_s) > 1.5 * tick for d in steps) or \
            abs((s.last_end - tail[0]) * tick - len(tail) * frame_s) > 1.5 * tick:
        return None
    frames = (s.last_end - s.first_pts) * tick * fps
    if abs(frames - round(frames)) > 0.25:  # not a whole number of frames: the rate is not what it claims
        return None
    s.n = s.n_data = int(round(frames))
    return s


def _duration(container, vs, scan: _PacketScan, header_frames: int) -> float:
    """The video's duration from its packet times (else the stream header, else the container); a file whose
    packets end well before its header says is ``truncated``."""
    tb = vs.time_base
    span = None
    if scan.first_pts is not None and scan.last_end is not None and tb is not None and scan.last_end > scan.first_pts:
        span = float((scan.last_end - scan.first_pts) * tb)
    header_duration = float(vs.duration * tb) if vs.duration and tb is not None else None
    if header_duration is None and MATROSKA in container.format.name.split(",") and container.duration:
        # Matroska tracks have no duration of their own; the segment's (all tracks, written at the start) is
        # what a truncated file claimed to be
        header_duration = container.duration / 1e6
    # Compare times, not packet counts: AVI and some codecs skip repeated frames (cinepak stores 68
    # packets for 444 frames), but a truncated file always ends early.
    if span is not None and header_duration and span < TRUNCATION_RATIO * header_duration:
        raise ProbeError("truncated", f"header says {header_duration:.2f} s but the packets end at {span:.2f} s"
                                      f"{' (' + scan.error + ')' if scan.error else ''}")
    if span is None and header_frames and scan.n < TRUNCATION_RATIO * header_frames:
        raise ProbeError("truncated", f"header claims {header_frames} frames but only {scan.n} could be read")
    # The stream's own duration can be missing (Ogg, MPEG-PS): fall back to packet times, then the container.
    duration = span or header_duration
    if not duration and container.duration:
        duration = container.duration / 1e6
    if not duration or duration <= 0:
        raise ProbeError("zero_duration", "the video stream has no duration")
    return duration


def _first_frame(av, container, vs) -> tuple[int, int, int]:
    """(rotation, width, height) from one decoded frame, which also proves the codec works."""
    container.seek(0)
    cc = vs.codec_context
    try:
        frame = next(container.decode(vs))
    except (StopIteration, av.error.FFmpegError) as e:
        raise ProbeError("undecodable", f"no frame of the {cc.name} stream decodes: {e}") from None
    width, height = frame.width, frame.height
    if not width or not height:
        raise ProbeError("undecodable", "the video stream has no frame size")
    return int(getattr(frame, "rotation", 0) or 0), width, height
