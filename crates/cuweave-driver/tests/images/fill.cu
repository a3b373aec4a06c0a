extern "C" __global__ void fill(unsigned* p, unsigned v, unsigned long long n){ unsigned long long i = blockIdx.x*(unsigned long long)blockDim.x+threadIdx.x; if(i<n) p[i]=v; }
