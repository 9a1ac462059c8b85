"""Who may talk to the server (app/guard.py): the Host check against DNS rebinding, cross-site
requests, the key on every Gradio route and the page's login, over HTTP against a Gradio page
launched as launch.py launches it, then against a real `launch.py` with the embedded model."""

import os
import stat
from pathlib import Path

import gradio as gr
import httpx
import pytest

from app.api import api_routes
from app.guard import guard, host_allowed, origin_allowed, policy
from app.store import ChatStore, default_store_path
from tests.conftest import free_port
from tests.conftest import start_aerie
from tests.fakes import KEY, USER, ApiFake

PREDICT = {"fn_index": 0, "data": [], "session_hash": "x"}


def launched(key: str | None):
    """A page with one endpoint that tells a secret, the API routes and the guard, as launch.py does."""
    with gr.Blocks() as demo:
        out = gr.Textbox()
        demo.load(lambda: "the saved chats", outputs=out, api_name="secret")
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                app_kwargs={"routes": api_routes(ApiFake(), key), "middleware": [guard("127.0.0.1", port, key)]})
    return demo, f"http://127.0.0.1:{port}", port


@pytest.fixture
def keyed():
    demo, url, port = launched(KEY)
    yield url, port
    demo.close()


@pytest.fixture
def open_page():
    demo, url, port = launched(None)
    yield url, port
    demo.close()


def test_hosts_and_origins_of_a_local_server():
    p = policy("127.0.0.1", 7860, None)
    assert all(host_allowed(p, h) for h in ("127.0.0.1:7860", "localhost:7860", "[::1]:7860", "LOCALHOST:7860"))
    assert not any(host_allowed(p, h) for h in ("rebind.attacker.example:7860", "127.0.0.1:7861", "127.0.0.1",
                                                "", "[::1", "10.0.0.2:7860"))
    assert origin_allowed(p, "http://localhost:7860") and not origin_allowed(p, "http://evil.example")
    assert not origin_allowed(p, "null") and not origin_allowed(p, "https://localhost:7860.evil.example")
    assert origin_allowed(policy("127.0.0.1", 7860, None, ("http://127.0.0.1:3000/",)), "http://127.0.0.1:3000")
    wild = policy("0.0.0.0", 7860, KEY)
    assert host_allowed(wild, "192.168.1.5:7860") and host_allowed(wild, "[fe80::1]:7860")
    assert not host_allowed(wild, "rebind.attacker.example:7860")


def test_a_foreign_host_is_refused_everywhere(open_page):
    url, port = open_page
    for method, path in (("GET", "/"), ("POST", "/gradio_api/run/predict"), ("GET", "/v1/models")):
        r = httpx.request(method, url + path, json=PREDICT, headers={"Host": f"rebind.attacker.example:{port}"})
        assert r.status_code == 421 and "DNS rebinding" in r.json()["error"]["message"]
    assert httpx.get(url + "/", headers={"Host": f"localhost:{port}"}).status_code == 200


def test_cross_site_requests_are_refused(open_page):
    url, port = open_page
    evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    r = httpx.post(url + "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "Hi"}]}',
                   headers=evil)
    assert r.status_code == 403 and "Cross-site" in r.json()["error"]["message"]
    assert httpx.post(url + "/gradio_api/run/predict", json=PREDICT, headers={"Origin": "null"}).status_code == 403
    own = httpx.post(url + "/v1/chat/completions", json={"messages": USER},
                     headers={"Origin": f"http://127.0.0.1:{port}"})
    assert own.status_code == 200


def test_with_a_key_every_gradio_route_needs_it(keyed):
    url, _ = keyed
    for method, path in (("POST", "/gradio_api/run/predict"), ("GET", "/config"), ("GET", "/gradio_api/info"),
                         ("POST", "/gradio_api/queue/join"), ("GET", "/gradio_api/queue/data?session_hash=x"),
                         ("GET", "/gradio_api/file=/etc/hostname"), ("GET", "/assets/index.js")):
        r = httpx.request(method, url + path, json=PREDICT if method == "POST" else None)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
    page = httpx.get(url + "/", headers={"Accept": "text/html"})
    assert page.status_code == 401 and "<form" in page.text and "the saved chats" not in page.text
    bearer = httpx.post(url + "/gradio_api/run/predict", json=PREDICT, headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200 and bearer.json()["data"] == ["the saved chats"]
    # /v1 keeps its own, OpenAI-shaped answer
    assert httpx.get(url + "/v1/models").json()["error"]["code"] == "invalid_api_key"


def test_the_login_form_sets_a_cookie_for_the_page(keyed):
    url, _ = keyed
    with httpx.Client(base_url=url) as browser:
        wrong = browser.post("/aerie/login", data={"key": "guess"})
        assert wrong.status_code == 401 and "not the key" in wrong.text and not browser.cookies
        right = browser.post("/aerie/login", data={"key": KEY})
        assert right.status_code == 303 and right.headers["location"] == "/"
        cookie = right.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and KEY.lower() not in cookie
        assert browser.get("/").status_code == 200
        assert browser.post("/gradio_api/run/predict", json=PREDICT).json()["data"] == ["the saved chats"]


def test_the_login_form_makes_a_guesser_wait(keyed):
    """Five wrong keys in a minute, then even the right one waits (429 with Retry-After)."""
    url, _ = keyed
    with httpx.Client(base_url=url) as browser:
        assert [browser.post("/aerie/login", data={"key": f"guess{i}"}).status_code for i in range(5)] == [401] * 5
        blocked = browser.post("/aerie/login", data={"key": KEY})
        assert blocked.status_code == 429 and 50 <= int(blocked.headers["retry-after"]) <= 60 and not browser.cookies


def test_the_login_throttle_forgets_a_minute_later():
    from app.guard import LoginThrottle
    now = [0.0]
    throttle = LoginThrottle(clock=lambda: now[0])
    for _ in range(5):
        assert throttle.wait_s() == 0
        throttle.failed()
    now[0] = 30.0
    assert throttle.wait_s() == 30.0
    now[0] = 60.0
    assert throttle.wait_s() == 0


def fn_index(url: str, api_name: str, headers: dict) -> int:
    deps = httpx.get(url + "/config", headers=headers).json()["dependencies"]
    return next(i for i, d in enumerate(deps) if d.get("api_name") == api_name)


@pytest.mark.slow
@pytest.mark.late
def test_a_real_aerie_guards_its_page_and_api_and_keeps_exports_private(embedded_dir, cache_dir, tmp_path):
    data, tmp = tmp_path / "data", tmp_path / "tmp"
    tmp.mkdir()
    store = ChatStore(default_store_path({"XDG_DATA_HOME": str(data)}, "linux"))
    store.append(store.create_chat().id, "user", "my secret plans")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "AERIE_API_KEY": KEY, "XDG_DATA_HOME": str(data), "TMPDIR": str(tmp)}
    env.pop("GRADIO_TEMP_DIR", None)
    proc, url = start_aerie(cache_dir, "--no-compile", env=env)
    port, auth = url.rsplit(":", 1)[1], {"Authorization": f"Bearer {KEY}"}
    try:
        assert httpx.get(url + "/config").status_code == 401
        latest, export = fn_index(url, "open_latest", auth), fn_index(url, "export", auth)
        leak = {"fn_index": latest, "data": [False], "session_hash": "x"}
        assert httpx.post(url + "/gradio_api/run/predict", json=leak).status_code == 401
        rebound = httpx.post(url + "/gradio_api/run/predict", json=leak,
                             headers={**auth, "Host": f"rebind.attacker.example:{port}"})
        assert rebound.status_code == 421
        body = b'{"messages": [{"role": "user", "content": "Hi"}]}'
        cross = httpx.post(url + "/v1/chat/completions", content=body,
                           headers={"Origin": "http://evil.example", "Content-Type": "text/plain"})
        assert cross.status_code == 403
        plain = httpx.post(url + "/v1/chat/completions", content=body, headers={**auth, "Content-Type": "text/plain"})
        assert plain.status_code == 415
        assert httpx.post(url + "/gradio_api/run/predict", json=leak, headers=auth).status_code == 200
        shown = httpx.post(url + "/gradio_api/run/predict", headers=auth,
                           json={"fn_index": export, "data": [1], "session_hash": "x"})
        copy = Path(shown.json()["data"][0]["value"]["path"])
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600
        private = next(p for p in copy.parents if p.parent == tmp)
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert httpx.get(f"{url}/gradio_api/file={copy}").status_code == 401
        assert "my secret plans" in httpx.get(f"{url}/gradio_api/file={copy}", headers=auth).text
        assert not copy.exists() and not list(private.glob("exports/export-*/*"))  # deleted once downloaded
        assert httpx.get(f"{url}/gradio_api/file={copy}", headers=auth).status_code != 200
    finally:
        proc.terminate()
        proc.wait(30)
    assert not list(tmp.iterdir())  # the private folder went with the server


def test_an_export_is_deleted_once_downloaded(tmp_path):
    """Gradio's copy of an export, and the export it came from, go when the copy has been sent;
    other files, files outside Gradio's folder and failed requests are left alone."""
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, Response
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from app.downloads import delete_after_download

    served, exports = tmp_path / "gradio", tmp_path / "exports"
    copy, other, outside = served / "abc" / "My-chat.json", served / "abc" / "logo.png", tmp_path / "elsewhere.md"
    original = exports / "export-1" / "My-chat.json"
    for path in (copy, other, outside, original):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("my secret plans")

    async def file(request):
        path = Path(request.path_params["path"])
        return FileResponse(path) if path.is_file() else Response(status_code=404)
    app = Starlette(routes=[Route("/gradio_api/file={path:path}", file)],
                    middleware=[delete_after_download(served, exports)])
    client = TestClient(app)
    assert client.get(f"/gradio_api/file={other}").status_code == 200 and other.exists()
    assert client.get(f"/gradio_api/file={outside}").status_code == 200 and outside.exists()
    assert client.get(f"/gradio_api/file={copy}").text == "my secret plans"
    assert not copy.exists() and not original.exists() and not original.parent.exists()
    assert client.get(f"/gradio_api/file={copy}").status_code == 404
