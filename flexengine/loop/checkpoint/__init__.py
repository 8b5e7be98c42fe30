"""Checkpoints on disk, single- and multi-rank: a standard HF directory plus the trainer state for an exact resume.

Layout of `<output_dir>/checkpoints/step_<N>/`:
  config.json, *.safetensors (or adapter_*), tokenizer files   the HF directory (`from_pretrained` loads it)
  trainer_state.pt                optimizer, scheduler, data position + data plan, RNG, counters (rank 0)
  trainer_state.rank<r>.pt        the same for rank r > 0 (its optimizer shard and RNG)
  merged/                         LoRA with train.merge_lora_on_save: base + adapters as a plain HF model
  manifest.json                   size and sha256 of every other file, the world size; written last

What makes it trustworthy:
- Every file is written into `.tmp_step_<N>_<host>_<pid>`, fsynced, and the directory is renamed into place
  only when all ranks have written their part, so a kill (or a power cut) at any moment leaves the previous
  checkpoint as it was. Temp directories of processes that are gone are removed at the next start.
- Free space is checked before writing (estimated from the bytes the tensors really store); a disk that fills
  during the write is a one-line error too, and the partial save is removed.
- Resume verifies the manifest (sizes, checksums, and no file it does not list) and falls back to the newest
  step that verifies, moving the damaged one aside (`step_<N>.corrupt`), never deleting it.
- Trainer state is read with `torch.load(weights_only=True)`: a planted pickle payload cannot run code. The
  state holds only tensors and Python primitives (the numpy RNG state is stored as a tensor), so the allow-list
  is empty for torch's own optimizers; only torchao's optimizer-state tensor subclasses are added.
- Nothing here deletes another run's files: an existing step directory is never overwritten.

The file-level safety (manifests, temp dirs, free space, the output directory) lives in core/storage.py; save.py
writes, load.py reads back (verify, resume, load), rank_sync.py holds the rank-0-decides collectives. The
trainer's side (what its state is, when it saves, how a resume restores it) is loop/checkpointer.py.
All ranks call `save_checkpoint`, `resolve_resume` and `load_checkpoint_*`; rank 0 writes the weights and decides,
the other ranks follow through collectives on a CPU group with its own long timeout (writing and hashing tens
of GB can outlast NCCL's 10 minutes). A failure on any rank fails the call on every rank, never a hang.

Why not torch.distributed.checkpoint (DCP) for the sharded optimizer state: it would add resharding (resume at
another world size), but in torch 2.13 its loader unpickles untrusted bytes: `FileSystemReader.read_metadata`
reads `.metadata` with plain `pickle.load`, and `DefaultLoadPlanner.load_bytes` reads every non-tensor entry
(optimizer param groups, steps) with `torch.load(weights_only=False)`. Adopting it would reopen the code-execution
hole that weights_only closes; each rank here already writes its own shard in parallel, and the HF export needs
the gathered weights anyway. Resume therefore needs the same world size, and says so.
"""
