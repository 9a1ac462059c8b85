"""The page's early script: put into the page's HTML before </head>, and nowhere else."""

from starlette.applications import Starlette
from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from app.page_head import page_head

PAGE = "<!doctype html><html><head><title>Aerie</title><script type='module' src='a.js'></script></head><body></body></html>"
SCRIPT = "window.early = 1;"
TAG = f"<script>{SCRIPT}</script>"


def client(page: str = PAGE, streamed: bool = False) -> TestClient:
    async def in_parts(request):
        async def parts():   # the head split across two parts, as a streamed page could be
            yield page[:20].encode()
            yield page[20:].encode()
        return StreamingResponse(parts(), media_type="text/html")
    routes = [Route("/", in_parts if streamed else lambda request: HTMLResponse(page)),
              Route("/other", lambda request: HTMLResponse(page)),
              Route("/json", lambda request: JSONResponse({"html": "</head>"}))]
    return TestClient(Starlette(routes=routes, middleware=[page_head(SCRIPT)]))


def test_the_page_carries_the_script_before_its_modules():
    response = client().get("/")
    assert response.status_code == 200
    assert response.text == PAGE.replace("</head>", TAG + "</head>")
    assert response.text.index(TAG) < response.text.index("</head>")
    assert int(response.headers["content-length"]) == len(response.content)


def test_other_routes_and_methods_are_left_as_they_are():
    c = client()
    assert c.get("/other").text == PAGE
    assert c.get("/json").json() == {"html": "</head>"}
    assert c.post("/").status_code == 405   # Starlette's answer, untouched


def test_a_page_without_a_head_is_served_whole_and_the_server_says_so(capsys):
    bare = "<html><body>hello</body></html>"
    response = client(bare).get("/")
    assert response.text == bare and int(response.headers["content-length"]) == len(bare)
    assert "no </head>" in capsys.readouterr().err


def test_a_page_sent_in_parts_is_joined_before_the_script_goes_in():
    response = client(streamed=True).get("/")
    assert response.text == PAGE.replace("</head>", TAG + "</head>")
    assert int(response.headers["content-length"]) == len(response.content)
