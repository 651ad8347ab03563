"""The openai text backend against a local OpenAI-compatible HTTP endpoint: the schema travels as
response_format (or guided_json), seeds and sampling are sent, answers and HTTP failures come back as results."""
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pipelines.inference.text_base import TextRequest
from pipelines.inference.text_openai import OpenAITextBackend
from pipelines.qra.json_schema import generation_schema


@pytest.fixture
def server():
    bodies, replies = [], []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append((self.path, body))
            status, content = replies.pop(0)
            payload = json.dumps({"choices": [{"message": {"content": content}, "finish_reason": "stop"}]}
                                 if status == 200 else {"error": content}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

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
    b = OpenAITextBackend(url, "served-model", guided_mode=mode, max_retries=0)
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
