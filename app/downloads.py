"""An exported chat is deleted as soon as it has been downloaded (issue 21).

An export is written to a private folder (app/chats.py), and Gradio copies it into its own cache
(GRADIO_TEMP_DIR, private too) and serves that copy at /gradio_api/file=PATH. Once such a copy
has been read whole into the response, this middleware deletes it, and the export it was copied from: a chat's text
does not wait on disk for a sweep. A second click on the same link then finds nothing (404);
exporting again makes a new file.
"""

import shutil
from pathlib import Path
from urllib.parse import unquote

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

FILE_ROUTE = "/gradio_api/file="
EXPORT_SUFFIXES = (".json", ".md")


class DeleteAfterDownload:
    def __init__(self, app: ASGIApp, served: Path, exports: Path):
        self.app, self.served, self.exports = app, served.resolve(), exports.resolve()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = self.export_copy(scope)
        if path is None:
            await self.app(scope, receive, send)
            return
        status = {"code": 0}

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False) and status["code"] == 200:
                # The file has been read whole into the responses: delete it before the last part goes
                # out, so a client that has the download finds it gone.
                self.forget(path)
            await send(message)

        await self.app(scope, receive, watch)

    def export_copy(self, scope: Scope) -> Path | None:
        """The Gradio copy of an export that this request downloads, else None."""
        if scope["type"] != "http" or scope["method"] != "GET" or not scope["path"].startswith(FILE_ROUTE):
            return None
        path = Path(unquote(scope["path"][len(FILE_ROUTE):])).resolve()
        return path if path.suffix in EXPORT_SUFFIXES and self.served in path.parents else None

    def forget(self, copy: Path) -> None:
        """Delete the downloaded copy (and its folder, once empty) and the export it came from."""
        copy.unlink(missing_ok=True)
        if copy.parent != self.served and not any(copy.parent.iterdir()):
            copy.parent.rmdir()
        for folder in self.exports.glob("export-*"):
            if (folder / copy.name).is_file():
                shutil.rmtree(folder)


def delete_after_download(served: Path, exports: Path) -> Middleware:
    """The middleware entry for launch.py: Gradio's cache folder and the exports folder."""
    return Middleware(DeleteAfterDownload, served=served, exports=exports)
