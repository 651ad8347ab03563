"""The openai text backend against a local OpenAI-compatible HTTP endpoint: the schema travels as
response_format (or guided_json), seeds and sampling are sent, answers and HTTP failures come back as results."""
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from longreel.engines.openai_engine import OpenAIEngine
from longreel.pipelines.qra.json_schema import generation_schema
from longreel.pipelines.qra.text_backend import TextBackend, TextRequest


def OpenAITextBackend(url: str, model: str, **kw) -> TextBackend:
    """The QRA stage's openai backend: its text adapter over the OpenAI-compatible engine."""
    return TextBackend(OpenAIEngine(url, model, **kw))


def _reply(handler: BaseHTTPRequestHandler, status: int, content: str) -> None:
    """An OpenAI chat-completions answer (``content`` as the message) or, for another status, an error body."""
    payload = json.dumps({"choices": [{"message": {"content": content}, "finish_reason": "stop"}]}
                         if status == 200 else {"error": content}).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


@pytest.fixture
def server():
    bodies, replies = [], []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append((self.path, body))
            _reply(self, *replies.pop(0))

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", bodies, replies
    httpd.shutdown()


@pytest.mark.parametrize("mode", ["response_format", "guided_json"])
def test_schema_and_sampling_are_sent(server, mode):
    url, bodies, replies = server
    schema = generation_schema(["open_ended"], min_questions=1, max_questions=1)
    replies += [(200, '{"questions": []}'), (400, "bad request")]
    b = OpenAITextBackend(url, "served-model", guided_mode=mode, max_retries=0, concurrency=1)  # replies in order
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "write"}]
    res = b.generate([TextRequest(messages=msgs, schema=schema, seed=7, temperature=0.5, top_p=0.9,
                                  repetition_penalty=1.1, max_new_tokens=50),
                      TextRequest(messages=msgs, schema=None)])
    b.close()
    assert res[0].text == '{"questions": []}' and res[0].error is None and res[0].guided
    assert res[1].finish == "error" and "400" in res[1].error  # a failure is a result, not an exception
    path, body = bodies[0]
    assert path == "/v1/chat/completions" and body["model"] == "served-model"
    assert body["messages"] == msgs and body["seed"] == 7 and body["max_tokens"] == 50
    assert body["temperature"] == 0.5 and body["top_p"] == 0.9 and body["repetition_penalty"] == 1.1
    if mode == "response_format":
        assert body["response_format"] == {"type": "json_schema", "json_schema": {
            "name": "qra_generation", "schema": schema, "strict": True}}
    else:
        assert body["guided_json"] == schema and body["structured_outputs"] == {"json": schema}
    assert "response_format" not in bodies[1][1] and "guided_json" not in bodies[1][1]


def test_a_videos_requests_are_in_flight_together_up_to_the_limit():
    """The backend is handed all of a video's calls: they overlap, at most ``concurrency`` at a time (the server
    holds each request until `concurrency` of them have arrived, or 10 s; it counts how many it held at once)."""
    from http.server import ThreadingHTTPServer

    limit, n = 3, 7
    state = {"now": 0, "most": 0}
    lock = threading.Condition()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
                lock.notify_all()
                lock.wait_for(lambda: state["now"] >= limit or state["most"] >= limit, timeout=10)
            with lock:
                state["now"] -= 1
            _reply(self, 200, str(body["seed"]))

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        b = OpenAITextBackend(f"http://127.0.0.1:{httpd.server_address[1]}/v1", "m", concurrency=limit, max_retries=0)
        msgs = [{"role": "user", "content": "write"}]
        res = b.generate([TextRequest(messages=msgs, schema=None, seed=s) for s in range(n)])
        b.close()
    finally:
        httpd.shutdown()
    assert [r.text for r in res] == [str(s) for s in range(n)]  # each answer back in its request's place
    assert state["most"] == limit  # overlapping, and never more than the limit
