@echo off
rem Aerie for Windows: double-click in Explorer to start the chat in a console window.
rem The checkout is the folder above this file. The window stays open if Aerie stops with an error.
cd /d "%~dp0.." || goto failed
where py >nul 2>nul
if errorlevel 1 (
    python launch.py %*
) else (
    py -3 launch.py %*
)
if errorlevel 1 goto failed
exit /b 0

:failed
echo.
echo Aerie stopped with an error (see above). It needs Python 3.10 or newer from python.org.
pause
exit /b 1
