"""What one GPU node does with this project (./run gpu-check): the default job, a resume, CPU against
GPU decode, the loader alone, the pixels; and the kit that brings it to a node without internet
(./run gpu-kit)."""
