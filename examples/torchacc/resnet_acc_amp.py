"""ResNet-50 with mixed precision: config.compute.bf16, and the loop's own
torch.cuda.amp.autocast / GradScaler (no-ops with a warning on a machine without CUDA).

    python examples/torchacc/resnet_acc_amp.py
"""

import time

import torch
from _sizes import resnet, sizes

import functacc as torchacc

args = sizes()
batch_size = args.batch_size
log_steps = args.log_steps
inputs = torch.randn(args.samples, 3, args.image_size, args.image_size)
labels = torch.randint(0, 100, (args.samples,))
dataset = torch.utils.data.TensorDataset(inputs, labels)
train_loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)

model = resnet(args.arch)

config = torchacc.Config()
config.compute.bf16 = True
model, train_loader = torchacc.accelerate(model, train_loader, config)
device = model.device
criterion = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=0.001)
scaler = torch.cuda.amp.GradScaler()

for epoch in range(args.epochs):
    model.train()
    start_time = time.time()
    for i, (inputs, labels) in enumerate(train_loader, 1):
        optimizer.zero_grad()
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):
            outputs = model(inputs)
            loss = criterion(outputs, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if i % log_steps == 0:
            iteration_time = time.time() - start_time
            throughputs = batch_size * log_steps / iteration_time
            print(
                f"Epoch: {epoch}, Step: {i}, Loss: {loss:.4f}, Throughputs: {throughputs:.4f} samples/s"
            )
            start_time = time.time()
